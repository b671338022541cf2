"""`tiercache demo` (and `make demo`): the main job a fresh machine can run end to end.

Until the RAG demo exists, the demo is the tier benchmark: it starts its own redis-server, measures
every tier against a plain reference in the same run and prints the table.
"""

from __future__ import annotations

import argparse

from shared.bench import tiers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    tiers.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    print("vllm-tiercache demo: tier throughput against plain copies, files and redis-py (same run)\n")
    return tiers.run(args)
