"""`OffStepJob`: the event tracker's one question at a time, answered off the step, applied on a later one."""

from __future__ import annotations

import threading

import pytest

from vllm_tiercache.kvcache.off_step import OffStepJob


def test_one_job_at_a_time_applied_once_by_the_caller() -> None:
    job = OffStepJob("test-off-step")
    gate, applied = threading.Event(), []
    assert job.idle and not job.apply_done()
    assert job.submit(lambda: gate.wait(10.0) and 7, applied.append)
    assert not job.submit(lambda: 8, applied.append)  # one is out: nothing more is posted
    assert not job.wait(0.05) and not job.apply_done() and applied == []
    gate.set()
    assert job.wait(10.0)
    assert not job.idle and applied == []  # finished, not applied until the caller's step asks
    assert job.apply_done() and applied == [7] and job.idle
    assert not job.apply_done() and applied == [7]
    assert threading.current_thread().name != "test-off-step"
    job.close()


def test_a_job_that_raises_is_logged_and_dropped_and_the_next_one_runs(caplog: pytest.LogCaptureFixture) -> None:
    job = OffStepJob("test-off-step-raises")
    applied: list[int] = []

    def broken() -> int:
        raise OSError("tier gone")

    assert job.submit(broken, applied.append) and job.wait(10.0)
    assert not job.apply_done() and applied == [] and job.idle
    assert "tier gone" in caplog.text
    assert job.submit(lambda: 3, applied.append) and job.wait(10.0) and job.apply_done() and applied == [3]
    job.close()


def test_close_applies_the_job_in_flight_and_posts_nothing_after() -> None:
    job = OffStepJob("test-off-step-close")
    applied: list[str] = []
    assert job.submit(lambda: "last", applied.append)
    job.close(10.0)
    assert applied == ["last"]
    assert not job.submit(lambda: "late", applied.append) and applied == ["last"]


def test_inline_runs_and_applies_at_once_in_the_caller() -> None:
    job = OffStepJob("inline", inline=True)
    threads: list[str] = []
    assert job.submit(lambda: threading.current_thread().name, threads.append)
    assert threads == [threading.current_thread().name] and job.idle


def test_start_runs_the_thread_before_any_job_and_a_closed_or_inline_job_starts_none() -> None:
    """The event tracker starts its job's thread when it is built, not on the scheduling thread's first step."""
    job = OffStepJob("tiercache-test-off-step-start")
    job.start()
    job.start()  # once
    assert [t.name for t in threading.enumerate()].count("tiercache-test-off-step-start") == 1
    applied: list[int] = []
    assert job.submit(lambda: 1, applied.append) and job.wait(10.0) and job.apply_done() and applied == [1]
    job.close()
    late = OffStepJob("tiercache-test-off-step-late")
    late.close()
    late.start()
    inline = OffStepJob("tiercache-test-off-step-inline", inline=True)
    inline.start()
    names = {t.name for t in threading.enumerate()}
    assert "tiercache-test-off-step-late" not in names and "tiercache-test-off-step-inline" not in names
