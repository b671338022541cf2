"""`tiercache unpin --tag T`: end a pin (`vllm_tiercache.tools.pin_cmd`); Redis records get ``ttl_s`` back."""

from __future__ import annotations

import argparse
import json

from vllm_tiercache.tools.jobs import load_store_arg
from vllm_tiercache.tools.pin_cmd import failed_line, failed_tiers, unpin
from vllm_tiercache.tools.tag_args import add_tag_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "End the pin of a tag: its records are evictable again."
    parser.add_argument("--config", required=True, metavar="STORE", help="store config: YAML/JSON file or inline JSON")
    add_tag_argument(parser, "the tag to unpin (repeatable)", required=True)
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    result = unpin(load_store_arg(args.config), args.tags)
    failed = failed_tiers(result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for t in result["tiers"]:
            if t.get("error"):
                print(failed_line(t))
        print(f"unpinned {', '.join(result['tags'])}"
              + (f" (not pinned before: {', '.join(result['unknown'])})" if result["unknown"] else "")
              + (f", except on {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
