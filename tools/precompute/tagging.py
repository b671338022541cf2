"""What both precompute jobs do with tags: ``--tag`` and ``--pin``, each item's tags, the pin at the end.

Why one module: `precompute docs` and `precompute images` tag their records alike (``doc:<name>``,
``image:<name>`` and the operator's ``--tag``), so `tiercache evict --tag doc:<name>` drops exactly one
document and `tiercache pin --tag corpus:v3` keeps a whole corpus.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.store.tags import MAX_TAG_LENGTH, validate_tags
from vllm_tiercache.tools.tag_args import add_tag_argument


def add_job_tag_arguments(parser: argparse.ArgumentParser) -> None:
    add_tag_argument(parser, "a tag every stored record carries besides its document/image name (repeatable), "
                             "e.g. corpus:v3")
    parser.add_argument("--pin", action="store_true",
                        help="pin the --tag tags once stored (tiercache pin; needs each tier's pin_budget)")


def check_pin_tags(tags: Sequence[str], pin: bool) -> list[str]:
    """The operator's tags, checked; ``--pin`` needs at least one (it pins them, not every document)."""
    checked = validate_tags(tags)
    if pin and not checked:
        raise ValueError("--pin pins the tags given with --tag; add one, e.g. --tag corpus:v3")
    return checked


def item_tags(kind: str, path: Path, tags: Sequence[str]) -> list[str]:
    """An item's tags: ``<kind>:<file name without suffix>`` (cut to the tag length limit; left out when it
    is no valid tag, e.g. a control character in the name), then ``tags``."""
    own = f"{kind}:{path.stem}"[:MAX_TAG_LENGTH]
    try:
        return validate_tags([own, *tags])
    except ValueError:
        return list(tags)


def pin_after_job(store_config: dict[str, Any], tags: Sequence[str]) -> str:
    """Pin ``tags`` (`tiercache pin`); raises as it does (a refused pin fails the job's exit status)."""
    from vllm_tiercache.tools.pin_cmd import pin

    pin(store_config, tags)
    return f"pinned {', '.join(tags)}"
