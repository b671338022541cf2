"""`tiercache bench pins` on a tiny trace, in-process (real stores: memory and a disk directory, the real pin).

Why so small: the three cases replay one stream through real stores; a few sessions show that the table
compares what it says (one-off traffic evicts an unpinned corpus, the pinned corpus keeps its hits), not
the figures docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse
import json

import pytest

from vllm_tiercache.tools.bench import pins
from vllm_tiercache.tools.cli import UsageError

TINY = ("--sessions", "16", "--docs", "8", "--doc-tokens", "256", "--chunk-size", "32", "--layers", "2",
        "--record-kib", "1")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pins.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_one_off_traffic_evicts_the_corpus_unless_it_is_pinned(tmp_path, capsys) -> None:
    assert pins.run(_args(*TINY, "--work-dir", str(tmp_path), "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    reference, flooded, pinned = report["cases"]
    assert [c["case"] for c in report["cases"]] == ["no one-off", "one-off", "one-off, pinned"]
    assert reference["corpus_hit"] == 1.0  # every document's prefix was precomputed, and nothing pushes it out
    assert flooded["corpus_hit"] < reference["corpus_hit"]  # the one-off records evicted some of it
    assert pinned["corpus_hit"] == reference["corpus_hit"]  # the pin kept all of it
    assert report["corpus_bytes"] < 0.9 * report["memory_bytes"]  # the corpus fits the pin budget of each tier
    assert list(tmp_path.iterdir()) == []  # the cases' directories are removed


def test_the_table_names_each_case_against_the_reference(tmp_path, capsys) -> None:
    assert pins.run(_args(*TINY, "--work-dir", str(tmp_path))) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "corpus hit" in lines[2] and "of reference" in lines[2]
    rows = {line[:16].strip(): line[16:].split() for line in lines if line.startswith(("no one-off", "one-off"))}
    assert list(rows) == ["no one-off", "one-off", "one-off, pinned"]
    assert rows["no one-off"][:2] == ["100.0%", "100.0%"]  # the reference against itself
    assert rows["one-off, pinned"][:2] == ["100.0%", "100.0%"]
    assert float(rows["one-off"][1].rstrip("%")) < 100.0


def test_a_trace_without_one_off_prompts_is_refused() -> None:
    with pytest.raises(UsageError, match="--one-off-share"):
        pins.run(_args(*TINY, "--one-off-share", "0"))
    with pytest.raises(SystemExit):
        _args("--pin-budget", "0.95")  # above the configured maximum of a pin budget
