"""`wait_until`: the tests' one way to wait for a state another thread or process reaches; `off_this_thread`:
a call that must return (not hang) run where its hang fails the test instead of the run.

Why one helper: a test on a loaded CI machine must wait for an event, never bet on a sleep; the limit only
ends a test that would otherwise hang, and it is generous (a minute) because it is no timing assertion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(what: str, predicate: Callable[[], object], limit_s: float = 60.0, poll_s: float = 0.05) -> None:
    """Return once ``predicate()`` is true; fail naming ``what`` when ``limit_s`` passed first."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(poll_s)


def off_this_thread(what: str, fn: Callable[[], T], limit_s: float = 60.0) -> T:
    """``fn()`` on a daemon thread of its own, waited for with `wait_until` (a call that hangs fails the test
    naming ``what``, and leaves no stuck test thread); its value returned, its exception raised here."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    threading.Thread(target=run, name=f"test-{what}", daemon=True).start()
    wait_until(what, lambda: out, limit_s=limit_s)
    if "error" in out:
        raise out["error"]
    return out["value"]
