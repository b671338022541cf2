"""`tiercache` command line: one dispatcher, each subcommand in the module that owns its feature.

A subcommand module defines `add_arguments(parser)` and `run(args) -> int`. Modules are imported only
when their command runs, so `tiercache --help` stays fast and never imports vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys

#: command words -> (module under `vllm_tiercache.tools`, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("bench", "tiers"): ("bench.tiers", "put/get throughput per tier vs plain copy, file and redis-py"),
    ("bench", "kv"): ("bench.kv", "TTFT of KV-cache hits per tier vs vLLM's own prefix cache"),
    ("bench", "ec"): ("bench.ec", "encoder-cache policy hit rates and per-image load latency"),
    ("bench", "policy"): ("bench.policy", "eviction policies vs vLLM's encoder cache manager and Belady"),
    ("demo",): ("demo", "the RAG demo: precompute, serve with both connectors, compare TTFT"),
    ("precompute", "images"): ("precompute.ec", "store encoder outputs of an image corpus (ec_producer)"),
    ("precompute", "docs"): ("precompute.kv", "store KV prefix chunks of a document corpus (kv_producer)"),
    ("identity",): ("identity_cmd", "the cache identity (weights digest, fingerprints) a server config uses"),
    ("stats",): ("stats_cmd", "entries, bytes and hit counters per tier and namespace"),
    ("evict",): ("evict_cmd", "remove records by namespace, model or age (after a model update)"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiercache", description="vllm-tiercache tools")
    groups: dict[str, argparse._SubParsersAction] = {}
    top = parser.add_subparsers(dest="command", required=True)
    for words, (module, help_text) in COMMANDS.items():
        sub_parent = top
        for depth, word in enumerate(words[:-1]):
            prefix = " ".join(words[: depth + 1])
            if prefix not in groups:
                group_parser = sub_parent.add_parser(word, help=f"{word} commands")
                groups[prefix] = group_parser.add_subparsers(dest=f"command_{depth + 1}", required=True)
            sub_parent = groups[prefix]
        leaf = sub_parent.add_parser(words[-1], help=help_text)
        leaf.set_defaults(_module=module)
        leaf.set_defaults(_lazy_args=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    # First pass, without -h: find which module owns the command; that module declares its own options.
    words = [arg for arg in argv if arg not in ("-h", "--help")]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            known, _ = parser.parse_known_args(words)
    except SystemExit:
        known = None
    if known is None:
        parser.parse_args(argv)  # prints the usage or the error for an unknown/incomplete command
        return 2
    depth = _command_depth(known)
    module = importlib.import_module(f"vllm_tiercache.tools.{known._module}")
    full = argparse.ArgumentParser(prog="tiercache " + " ".join(words[:depth]))
    module.add_arguments(full)
    args = full.parse_args(argv[depth:])
    return int(module.run(args) or 0)


def _command_depth(namespace: argparse.Namespace) -> int:
    return 1 + sum(1 for name in vars(namespace) if name.startswith("command_"))


if __name__ == "__main__":
    sys.exit(main())
