"""`wait_until`: the tests' one way to wait for a state another thread or process reaches.

Why one helper: a test on a loaded CI machine must wait for an event, never bet on a sleep; the limit only
ends a test that would otherwise hang, and it is generous (a minute) because it is no timing assertion.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(what: str, predicate: Callable[[], object], limit_s: float = 60.0, poll_s: float = 0.05) -> None:
    """Return once ``predicate()`` is true; fail naming ``what`` when ``limit_s`` passed first."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(poll_s)
