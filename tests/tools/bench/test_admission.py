"""`tiercache bench admission` on a tiny trace, in-process (a real store: memory and a disk directory).

Why so small: the command's cases replay the same stream through real stores; a few sessions and one-off
prompts show that the table compares what it says it compares (the reference writes every record, seen:2
refuses and writes less, one-off prompts never hit), not the figures docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse

import pytest

from vllm_tiercache.tools.bench import admission


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    admission.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_table_compares_write_through_with_seen(tmp_path, capsys):
    args = _args("--policies", "always,seen:2", "--one-off-share", "0.5", "--sessions", "4", "--users", "2",
                 "--turns", "2", "--docs", "2", "--doc-tokens", "128", "--chunk-size", "32", "--layers", "2",
                 "--record-kib", "1", "--no-redis", "--work-dir", str(tmp_path), "--json")
    assert admission.run(args) == 0
    import json

    always, seen = json.loads(capsys.readouterr().out)["cases"]
    assert always["writes_refused"]["disk"] == 0 and seen["writes_refused"]["disk"] > 0
    assert 0 < seen["bytes_written"]["disk"] < always["bytes_written"]["disk"]
    assert always["one_off_hit"] == 0.0 and always["repeated_hit"] > 0
    assert seen["repeated_hit"] <= always["repeated_hit"]


def test_seen_only_is_seen_without_reuse_admission():
    (seen,), (only,) = admission.policy_arg("seen:2"), admission.policy_arg("seen-only:3")
    assert seen == ("seen:2", {"policy": "seen", "min_seen": 2})
    assert only == ("seen-only:3", {"policy": "seen", "min_seen": 3, "reused_prompt_share": None})


def test_bad_cases_are_usage_errors():
    with pytest.raises(SystemExit):
        _args("--policies", "seen:1")
    with pytest.raises(SystemExit):
        _args("--policies", "sometimes")
    with pytest.raises(SystemExit):
        _args("--policies", "seen-only:1")
