"""`scripts/run_tests.sh`, what `make test` and CI run: its two passes side by side (the rest niced, the serial
tests at the caller's priority), its exit code, its output's order, and `TIERCACHE_TEST_SEQUENTIAL`.

Driven with a stand-in for Python that records how each pass was started (its arguments, its niceness, when
it ran) instead of running pytest: the passes themselves are the rest of this suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "run_tests.sh"

#: Stands in for `.venv/bin/python`: which pass it is comes from its ``-m serial`` argument
FAKE_PYTHON = """#!/usr/bin/env bash
case " $* " in *" -m serial "*) pass=2 ;; *) pass=1 ;; esac
echo "start $pass $(ps -o ni= -p $$ | tr -d ' ') $(date +%s.%N)" >> "$RECORD"
echo "output of pass $pass"
if [ -n "${MEET:-}" ]; then  # wait (20 s at most) for the other pass to have started: both run at once
  for _ in $(seq 400); do
    [ "$(grep -c '^start' "$RECORD")" -ge 2 ] && { echo "met $pass" >> "$RECORD"; break; }
    sleep 0.05
  done
fi
trap 'kill $!; echo "interrupted $pass" >> "$RECORD"; exit 2' INT  # no effect where SIGINT came in ignored
sleep "${HOLD_S:-0}" & wait $!
echo "end $pass $(date +%s.%N)" >> "$RECORD"
rc=PASS${pass}_RC
exit "${!rc:-0}"
"""


def _start(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    """The script in a session of its own (as a terminal's foreground job: SIGINT not ignored)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "record").unlink(missing_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in ("TIERCACHE_TEST_SEQUENTIAL", "PASS1_NICE")}
    return subprocess.Popen(["bash", str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            env={**base, "PY": str(fake), "RECORD": str(tmp_path / "record"),
                                 "TMPDIR": str(tmp_path / "tmp"), **env})


def _runs(tmp_path: Path) -> dict[str, dict[str, float]]:
    """What the stand-in recorded, per pass: its niceness, start and end (or that it was interrupted)."""
    runs: dict[str, dict[str, float]] = {}
    for line in (tmp_path / "record").read_text().splitlines():
        what, number, *values = line.split()
        if what == "start":
            runs.setdefault(number, {}).update(nice=float(values[0]), start=float(values[1]))
        elif what == "end":
            runs.setdefault(number, {})["end"] = float(values[0])
        else:  # "met" or "interrupted"
            runs.setdefault(number, {})[what] = 1.0
    assert list((tmp_path / "tmp").iterdir()) == [], "the serial pass's log was left in the temp directory"
    return runs


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[str, float]]]:
    proc = _start(tmp_path, **env)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), _runs(tmp_path)


def test_the_passes_run_side_by_side_the_rest_niced_and_print_in_order(tmp_path: Path) -> None:
    proc, runs = _run(tmp_path, MEET="1")
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert runs["1"]["nice"] == min(own + 10, 19) and runs["2"]["nice"] == own, runs
    assert runs["1"].get("met") and runs["2"].get("met"), runs  # each saw the other running
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


def test_a_ctrl_c_interrupts_both_passes_and_ends_the_run(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches pass 1 with the script's group; the script then interrupts pass 2, which
    a script's background command would otherwise ignore, running its four minutes to the end."""
    proc = _start(tmp_path, HOLD_S="60")
    record = tmp_path / "record"
    while record.read_text().count("start") < 2 if record.exists() else True:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)  # a hang bound: each pass would hold 60 s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    runs = _runs(tmp_path)
    assert proc.returncode == 130, out
    assert all(runs[n].get("interrupted") and "end" not in runs[n] for n in ("1", "2")), runs
