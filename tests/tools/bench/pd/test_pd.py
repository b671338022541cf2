"""`tiercache bench pd`'s report, without servers: the table's ratios and its missing values."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_tiercache.tools.bench.pd.client import promised_tokens
from vllm_tiercache.tools.bench.pd.command import format_table, kv_bytes, worker_cores
from vllm_tiercache.tools.bench.pd.handoffs import format_handoffs
from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec, make_tiny_llama


def test_the_table_gives_the_decode_against_each_reference() -> None:
    row = {"tokens": 2048, "plain_s": 0.5, "resident_s": 0.02, "prefill_s": 0.5, "decode_s": 0.05,
           "redis_s": 0.02, "fetch_s": 0.01, "copy_s": 0.005, "wait_s": 0.001, "fallbacks": 0,
           "resident_queued_s": 0.001, "resident_prefill_s": 0.012, "decode_queued_s": 0.03, "decode_prefill_s": 0.011}
    missing = {**row, "tokens": 8192, "redis_s": None, "fetch_s": None, "decode_queued_s": None}
    table = format_table({"model": "m", "prompts": 3, "wait_ms": 1000.0, "reserved_cpus": 1, "rows": [row, missing]})
    assert ("| 2048 | 500 ms | 20 ms | 20 ms | 50 ms | 0.10x | 1.00x | 1 ms + 10 ms + 5 ms | 1 ms + 12 ms "
            "| 30 ms + 11 ms | 0 |") in table
    assert "| 8192 | 500 ms | 20 ms | n/a | 50 ms | 0.10x | n/a | n/a | 1 ms + 12 ms | n/a + 11 ms | 0 |" in table


def test_kv_bytes_of_the_model(tmp_path: Path) -> None:
    spec = TinyLlamaSpec()
    model = make_tiny_llama(tmp_path / "m", spec)
    head = spec.hidden_size // spec.num_heads
    assert kv_bytes(model, 100) == spec.num_layers * 2 * spec.num_kv_heads * head * 2 * 100


def test_the_handoff_run_counts_full_blocks_short_of_the_last_token_and_reports_silent_recomputes() -> None:
    assert promised_tokens(640, 32) == 608 and promised_tokens(641, 32) == 640 and promised_tokens(20, 32) == 0
    run = {"handoffs": 50, "lengths": [600], "promised_tokens": 28800, "taken_tokens": 28800, "taken_share": 1.0,
           "received": 50, "loads": 50, "fallbacks": 0, "missing_records": 0, "rejected": 0,
           "silent_recompute_tokens": 0, "identical_outputs": 50}
    table = format_handoffs({"model": "m", "wait_ms": 3000.0, "handoff_run": run})
    assert "| 50 | 28800 | 28800 | 100.00% | 50 | 50 | 0 | 0 | 0 | 50/50 |" in table
    fell_back = {**run, "taken_tokens": 28224, "taken_share": 0.98, "fallbacks": 1, "silent_recompute_tokens": None}
    assert "| 98.00% | 50 | 50 | 1 | 0 | n/a (fallbacks counted) | 50/50 |" in format_handoffs(
        {"model": "m", "wait_ms": 3000.0, "handoff_run": fell_back})


def test_bind_gives_the_consumer_cores_of_its_own_and_needs_two() -> None:
    assert worker_cores([0, 1]) == {"plain": "0", "producer": "0", "consumer": "1"}
    assert worker_cores([0, 1, 2, 3, 4]) == {"plain": "0,1", "producer": "0,1", "consumer": "2,3,4"}
    with pytest.raises(SystemExit, match="--bind needs at least 2 cores; this process may use 1"):
        worker_cores([3])
