"""`tiercache bench kv-sched`: the stored prompts' TTFT behind long background prefills (``--background-len``),
the undelayed far arm ``far0`` and the ratio to it, ``--arms``; a quick real run of two arms. No timings are
asserted beyond their order."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.zygote_client import run_job
from tests.tools.test_cli_errors import assert_one_line_error, tiercache_here
from vllm_tiercache.tools.bench.kv import sched
from vllm_tiercache.tools.cli import UsageError


def _row(arm: str, ttft_p50: float, hit_tokens: int) -> dict:
    return {"arm": arm, "steps": 10, "idle_steps": 0, "hit_tokens": hit_tokens, "sched_p50_ms": 0.2,
            "sched_p99_ms": 1.0, "sched_max_ms": 1.0, "step_p50_ms": 3.0, "step_p99_ms": 50.0,
            "hit_not_ready": 0, "hit_not_ready_at_turn": 0, "hit_queued_p50_ms": ttft_p50 - 5.0,
            "hit_ttft_p50_ms": ttft_p50,
            "hit_ttft_max_ms": ttft_p50 + 7.0}


def _report(*arms: dict) -> dict:
    return {"store": "object", "store_rtt_ms": 20.0, "hits": 8, "background": 4, "background_len": 2048,
            "step_tokens": 2048, "prompt_len": 1024, "arms": list(arms)}


def test_the_table_names_the_rtt_and_gives_each_arms_hit_ttft_over_far0s() -> None:
    table = sched.format_table(_report(_row("vllm", 900.0, 0), _row("far", 330.0, 7936), _row("far0", 300.0, 7936)))
    lines = table.splitlines()
    assert lines[0].startswith("store RTT +20 ms: the object tier behind a proxy"), lines[0]
    assert "8 stored prompts of 1024 tokens arriving after 4 decoding prompts of 2048 tokens" in lines[1]
    assert "2048 tokens per step" in lines[1] and "object 20 ms away (far0: 0 ms)" in lines[1]
    assert "queued p50" in lines[2] and "TTFT p50" in lines[2] and "TTFT max" in lines[2]
    assert "TTFT p50/far0" in lines[2] and "sched p99/vllm" in lines[2] and "not ready" in lines[2]
    assert "at turn" in lines[2]
    rows = {line.split()[0]: line.split() for line in lines[3:6]}
    assert rows["vllm"][-6:] == ["0", "0", "895.0m", "900.0m", "907.0m", "3.00"]
    assert rows["far"][-4:] == ["325.0m", "330.0m", "337.0m", "1.10"]
    assert rows["far0"][-1] == "1.00" and rows["far0"][3] == "7936"


def test_the_scheduling_threads_own_cpu_p99_is_set_beside_its_wall_time() -> None:
    far = {**_row("far", 330.0, 7936), "sched_p99_ms": 3.0, "sched_cpu_p99_ms": 1.1,
           "connector_cpu_p99_ms": 0.3, "connector_cpu_sum_ms": 12.5, "vllm_cpu_p99_ms": 0.9}
    vllm = {**_row("vllm", 900.0, 0), "sched_cpu_p99_ms": 1.0, "connector_cpu_p99_ms": 0.0, "vllm_cpu_p99_ms": 1.0}
    lines = sched.format_table({**_report(vllm, far), "executor": "mp"}).splitlines()
    assert "--executor mp" in lines[1] and "cpu p99" in lines[2] and "cpu p99/vllm" in lines[2], lines
    assert "conn p99" in lines[2] and "conn sum" in lines[2] and "rest p99/vllm" in lines[2], lines
    # arm steps idle hit-tok sched-p50 sched-p99 max cpu-p99 step-p50 step-p99, then the ratios: sched, cpu,
    # the connector's CPU p99 and its sum over the run, vLLM's own (the rest) over vllm's cpu p99, step
    far_row = lines[4].split()
    assert far_row[7] == "1.10m" and far_row[10:15] == ["3.00", "1.10", "0.30m", "12.5m", "0.90"], far_row
    assert lines[3].split()[12:15] == ["0.00m", "0.0m", "1.00"], lines[3]


def test_without_far0_the_ratio_is_a_dash() -> None:
    table = sched.format_table(_report(_row("vllm", 900.0, 0), _row("far", 330.0, 7936)))
    assert [line.split()[-1] for line in table.splitlines()[3:5]] == ["-", "-"]


def test_arms_are_checked() -> None:
    assert sched.arm_list("vllm,far0") == ("vllm", "far0")
    assert sched.ARMS == ("vllm", "sync", "far", "far0")


@pytest.mark.parametrize(("flag", "value", "piece"), [
    ("--arms", "far,far0", "vllm among them"),
    ("--arms", "vllm,fast", "invalid value 'vllm,fast'"),
    ("--arms", "vllm,far,far", "each once"),
    ("--background-len", "0", "from 1 to 32768"),
    ("--lookup-deadline-ms", "0", "from 1 to 60000"),
])
def test_bad_arms_and_background_lengths_are_one_line_errors(flag: str, value: str, piece: str) -> None:
    assert_one_line_error(tiercache_here("bench", "kv-sched", flag, value), flag, piece)


def test_a_failed_arm_names_its_root_cause_and_keeps_its_log(tmp_path) -> None:
    """An arm's process that exits non-zero: the bench stops with what its log says and where the log is.
    (An executor the arm refuses: it exits before any engine starts.)"""
    parser = argparse.ArgumentParser()
    sched.add_arguments(parser)
    args = parser.parse_args(["--quick"])
    args.executor = "bogus"
    with pytest.raises(RuntimeError) as raised:
        sched._run_process(args, "vllm", {"model": str(tmp_path / "model"), "namespace": "x", "tiers": []}, tmp_path)
    message = str(raised.value)
    assert message.startswith("arm vllm exited with 2: ") and "--executor" in message, message
    assert f"(log: {tmp_path / 'arm-vllm.log'})" in message
    assert "invalid choice: 'bogus'" in (tmp_path / "arm-vllm.log").read_text()


def test_an_arm_past_its_time_is_stopped_and_named_with_its_log(tmp_path, monkeypatch) -> None:
    """An arm that runs past `ARM_TIMEOUT_S` (a hung engine or store) is killed and the bench stops with its
    log's path, instead of waiting for ever. (Half a second: less than the arm's imports alone take.)"""
    parser = argparse.ArgumentParser()
    sched.add_arguments(parser)
    args = parser.parse_args(["--quick"])
    monkeypatch.setattr(sched, "ARM_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError) as raised:
        sched._run_process(args, "vllm", {"model": str(tmp_path / "model"), "namespace": "x", "tiers": []}, tmp_path)
    message = str(raised.value)
    assert message.startswith("arm vllm ran past 0.5s and was stopped; its log says: "), message
    assert message.endswith(f"(log: {tmp_path / 'arm-vllm.log'})"), message


def test_a_runs_temp_dir_goes_after_success_and_stays_after_a_failure_whose_error_names_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    sched.add_arguments(parser)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def failing(args: argparse.Namespace, work: Path) -> dict:
        (work / "arm-far.log").write_text("ValueError: boom\n")
        raise RuntimeError(f"arm far exited with 1: ValueError: boom (log: {work / 'arm-far.log'})")

    monkeypatch.setattr(sched, "_measure", failing)
    with pytest.raises(RuntimeError) as raised:
        sched.run(parser.parse_args([]))
    (kept,) = tmp_path.glob("tiercache-bench-kv-sched-*")
    assert str(kept / "arm-far.log") in str(raised.value) and (kept / "arm-far.log").read_text(), raised.value

    def measured(args: argparse.Namespace, work: Path) -> dict:
        (work / "model").mkdir()
        return {"arms": []}

    monkeypatch.setattr(sched, "_measure", measured)
    assert sched.run(parser.parse_args(["--json"])) == 0
    assert list(tmp_path.glob("tiercache-bench-kv-sched-*")) == [kept]  # the successful run's is gone
    mine = tmp_path / "mine"
    assert sched.run(parser.parse_args(["--json", "--work-dir", str(mine)])) == 0
    assert (mine / "model").is_dir()  # --work-dir: kept
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UsageError, match="--work-dir"):
        sched.run(parser.parse_args(["--work-dir", str(tmp_path / "a-file")]))


@pytest.mark.engine
def test_quick_run_times_the_stored_prompts_behind_a_long_prefill(tmp_path: Path) -> None:
    # the longest lookup deadline: what is asserted below is that each stored prompt hits, on a loaded CI
    # machine too, where a fetch may wait on a core longer than the default second
    done = run_job([sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "kv-sched", "--quick", "--store",
                    "redis", "--background-len", "512", "--arms", "vllm,far0", "--lookup-deadline-ms", "60000",
                    "--json"],
                   env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=os.getcwd(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(tmp_path.glob("tiercache-bench-kv-sched-*")), "the run's temp dir (its model, logs) was left"
    report = json.loads(done.stdout)
    assert report["background_len"] == 512 and report["step_tokens"] == 512, report
    assert report["executor"] == "uni" and all(row["executor"] == "uni" for row in report["arms"]), report
    rows = {row["arm"]: row for row in report["arms"]}
    assert list(rows) == ["vllm", "far0"], report
    assert rows["vllm"]["hit_not_ready"] == 0 and rows["vllm"]["far_counters"] == {}, rows
    assert rows["vllm"]["hit_tokens"] == 0, rows  # no connector: full prefills
    # the far tier gave each stored prompt all its chunks but the last block's worth vLLM recomputes
    assert rows["far0"]["hit_tokens_each"] == [512 - 2 * 16] * 2, rows
    assert rows["far0"]["hit_allocated_tokens_each"] == [[512 - 2 * 16]] * 2, rows  # answered and allocated once
    # the deadline counters, summed over the run (the engine takes them each step)
    assert {"lookups_late", "prefetches_late", "prefetches_evicted"} <= set(rows["far0"]["far_counters"]), rows
    assert rows["far0"]["hit_answered_p50_ms"] > 0 and rows["far0"]["background_all_scheduled_ms"] > 0, rows
    for row in rows.values():  # queued behind the background's one-step prefill, then their own step
        assert 0 < row["hit_queued_p50_ms"] <= row["hit_ttft_p50_ms"] <= row["hit_ttft_max_ms"], row
    for row in rows.values():  # the scheduling thread's own CPU is within its wall time, step by step
        assert row["worst_sched_steps"] and row["sched_cpu_p99_ms"] > 0, row
        # (two clocks read a few instructions apart: a few microseconds either way)
        assert all(0 < s["thread_cpu_ms"] <= s["wall_ms"] + 0.05 for s in row["worst_sched_steps"]), row
        # the connector's part of it: one clock, its calls inside the scheduler's
        assert all(0 <= s["connector_cpu_ms"] <= s["thread_cpu_ms"] + 1e-6 for s in row["worst_sched_steps"]), row
    assert rows["vllm"]["connector_cpu_p99_ms"] == 0 and rows["far0"]["connector_cpu_p99_ms"] > 0, rows
    # the sum over the run holds every step's connector CPU: the slowest steps' and the p99 step's among them
    assert rows["vllm"]["connector_cpu_sum_ms"] == 0, rows
    far0 = rows["far0"]
    assert far0["connector_cpu_sum_ms"] + 1e-6 >= max(
        far0["connector_cpu_p99_ms"], sum(s["connector_cpu_ms"] for s in far0["worst_sched_steps"])), far0
    assert 0 < rows["far0"]["vllm_cpu_p99_ms"] <= rows["far0"]["sched_cpu_p99_ms"], rows
    table = sched.format_table(report)
    assert "TTFT p50/far0" in table and "--executor uni" in table and "lookup_deadline_ms 60000" in table
