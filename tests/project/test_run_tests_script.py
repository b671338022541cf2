"""`scripts/run_tests.sh`, what `make test` and CI run: its two passes side by side (the rest niced, the serial
tests at the caller's priority), its exit code, its output's order, and `TIERCACHE_TEST_SEQUENTIAL`.

Driven with a stand-in for Python that records how each pass was started (its arguments, its niceness, when
it ran) instead of running pytest: the passes themselves are the rest of this suite.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "run_tests.sh"

#: Stands in for `.venv/bin/python`: which pass it is comes from its ``-m serial`` argument
FAKE_PYTHON = """#!/usr/bin/env bash
case " $* " in *" -m serial "*) pass=2 ;; *) pass=1 ;; esac
echo "start $pass $(ps -o ni= -p $$ | tr -d ' ') $(date +%s.%N)" >> "$RECORD"
echo "output of pass $pass"
sleep "${HOLD_S:-0}"
echo "end $pass $(date +%s.%N)" >> "$RECORD"
rc=PASS${pass}_RC
exit "${!rc:-0}"
"""


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[str, float]]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    record, temp = tmp_path / "record", tmp_path / "tmp"
    record.unlink(missing_ok=True)
    temp.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in ("TIERCACHE_TEST_SEQUENTIAL", "PASS1_NICE")}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**base, "PY": str(fake), "RECORD": str(record), "TMPDIR": str(temp), **env})
    runs: dict[str, dict[str, float]] = {}
    for line in record.read_text().splitlines():
        what, number, *values = line.split()
        if what == "start":
            runs.setdefault(number, {}).update(nice=float(values[0]), start=float(values[1]))
        else:
            runs.setdefault(number, {})["end"] = float(values[0])
    assert list(temp.iterdir()) == [], "the serial pass's log was left in the temp directory"
    return proc, runs


def test_the_passes_run_side_by_side_the_rest_niced_and_print_in_order(tmp_path: Path) -> None:
    proc, runs = _run(tmp_path, HOLD_S="1")
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert runs["1"]["nice"] == min(own + 10, 19) and runs["2"]["nice"] == own, runs
    assert runs["2"]["start"] < runs["1"]["end"] and runs["1"]["start"] < runs["2"]["end"], runs  # side by side
    out = proc.stdout
    assert out.index("output of pass 1") < out.index("pass 2 of 2") < out.index("output of pass 2"), out


@pytest.mark.parametrize("failing, named", [("PASS1_RC", "pass 1 exit 1, pass 2 exit 0"),
                                             ("PASS2_RC", "pass 1 exit 0, pass 2 exit 1")])
def test_a_failed_pass_fails_the_run_naming_it(tmp_path: Path, failing: str, named: str) -> None:
    proc, runs = _run(tmp_path, **{failing: "1"})
    assert proc.returncode == 1 and f"FAILED ({named}" in proc.stdout, proc.stdout
    assert set(runs) == {"1", "2"}, runs  # both passes always run


def test_sequential_runs_the_serial_tests_after_the_rest_at_the_same_priority(tmp_path: Path) -> None:
    proc, runs = _run(tmp_path, TIERCACHE_TEST_SEQUENTIAL="1", HOLD_S="0.2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert runs["1"]["end"] <= runs["2"]["start"], runs
    assert runs["1"]["nice"] == runs["2"]["nice"] == os.getpriority(os.PRIO_PROCESS, 0), runs
