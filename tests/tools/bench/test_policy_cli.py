"""`tiercache bench policy` end to end, as a user runs it: the table, the target checks and the memory-tier part.

Why a subprocess: the command is a deliverable on its own (docs/benchmarks.md quotes its output), and the
unit tests in test_ec_managers.py call its functions, not the CLI that parses options and prints.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.tools.test_cli_errors import tiercache_here
from vllm_tiercache.shared.eviction import policy_names

REPO = Path(__file__).resolve().parents[3]


def test_bench_policy_prints_every_trace_and_the_target_checks() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "policy", "--quick",
         "--exponents", "1.0", "--capacities", "0.05"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for trace in ("zipf 1.0, 5%", "shifting 1.0, 5%", "scan 1.0, 5%", "var-size 1.0, 5%"):
        rows = [line for line in out.splitlines() if line.startswith(trace)]
        assert rows, f"no row for {trace!r}:\n{out}"
        rates = [float(x) for x in re.findall(r"(?<![\d(])0\.\d{3}(?!\d)", rows[0])]
        # vLLM, one per registered policy (LRU, LFU, W-TinyLFU, ...), oracle, Belady: hit rates in [0, 1],
        # Belady the highest
        assert len(rates) == 3 + len(policy_names()) and all(0.0 <= r <= 1.0 for r in rates), rows[0]
        if not trace.startswith("var-size"):  # size-aware Belady is a greedy approximation, not a bound
            assert rates[-1] == max(rates), f"Belady must bound every policy on {trace}: {rows[0]}"
    checks = [line for line in out.splitlines() if line.startswith(("[ok]", "[BELOW]"))]
    assert len(checks) == 3, out
    assert any("shifting" in line and line.startswith("[ok]") for line in checks), checks
    assert any("scan" in line and line.startswith("[ok]") for line in checks), checks
    assert "== memory tier" in out and "refused" in out


def test_bench_policy_bounds_its_options() -> None:
    """A trace too short for the 4-phase shifting trace was a ZeroDivisionError traceback; a capacity of 0 ran."""
    for bad in (["--requests", "3"], ["--capacities", "0.05", "0"], ["--images", "1"], ["--exponents", "-1"]):
        # in this process: a refusal needs no interpreter of its own
        proc = tiercache_here("bench", "policy", "--requests", "100", "--images", "10", *bad)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.startswith("tiercache: error: argument ") and proc.stderr.count("\n") == 1, proc.stderr
        assert f"invalid value {bad[-1]!r}; allowed: " in proc.stderr, proc.stderr
