"""The ``--tag`` option the commands share (`evict`, `pin`, `unpin`, `precompute docs|images`), checked by
`vllm_tiercache.shared.store.tags.check_tag` so every command refuses a bad tag in the same words."""

from __future__ import annotations

import argparse

from vllm_tiercache.shared.store.tags import check_tag


def tag_arg(text: str) -> str:
    """A ``--tag`` value, checked (`check_tag`): argparse's one-line error otherwise."""
    try:
        return check_tag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_tag_argument(parser: argparse.ArgumentParser, help_text: str, *, required: bool = False) -> None:
    """``--tag TAG``, repeatable, into ``args.tags``."""
    parser.add_argument("--tag", dest="tags", action="append", default=[], type=tag_arg, metavar="TAG",
                        required=required, help=help_text)
