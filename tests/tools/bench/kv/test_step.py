"""`tiercache bench kv-step --quick`, the CI smoke run: a real engine decodes with the connector, every
step's connector calls are counted, and the report accounts for them. No timings are asserted."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.zygote_client import run_job


@pytest.mark.engine
def test_quick_run_counts_the_connectors_calls_per_decode_step() -> None:
    done = run_job([sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "kv-step", "--quick", "--json"],
                   env=dict(os.environ), cwd=os.getcwd(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    # the second send's prompts come from vLLM's prefix cache: the measured steps decode
    assert report["prefix_cached_tokens"] >= report["prompt_len"] - 32, report
    # every token but the first (sampled by the prefill step) needs a step of its own
    assert report["new_tokens"] <= report["steps"] <= report["new_tokens"] + 2, report
    calls = {row["method"]: row["calls_per_step"] for row in report["methods"]}
    # both sides ran in this process: the scheduler's plan and the worker's load/save hooks, every step
    assert calls["build_connector_meta"] == 1 and calls["start_load_kv"] == 1, calls
    assert calls["get_kv_connector_stats"] == 2, calls  # the scheduler's and the worker's
    assert calls["take_events"] == 1, calls  # vLLM asks for KV cache events every step, on or off
    assert calls["save_kv_layer"] == calls["wait_for_layer_load"] == 4, calls  # once per layer (4 layers)
    total = sum(row["us_per_step"] for row in report["methods"])
    assert abs(total - report["connector_us_per_step"]) < 1e-6 * max(total, 1), report
    assert 0 < report["connector_share"] < 1 and report["step_ms"] > 0, report
    # the step thread's CPU per method: never more than the method's wall time (plus the clocks' grain)
    cpu = sum(row["cpu_us_per_step"] for row in report["methods"])
    assert abs(cpu - report["connector_cpu_us_per_step"]) < 1e-6 * max(cpu, 1), report
    assert 0 < cpu <= total * 1.05 + 5, report
    # the connector's background threads, by name (work moved off the step is still counted)
    assert "tiercache-kv-saver" in report["threads_cpu_us_per_step"], report
    assert "decoding" in done.stderr  # progress
