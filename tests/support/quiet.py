"""Waiting for a writer nobody can ask to finish: until what it writes stops changing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until_quiet(snapshot: Callable[[], Any], quiet_s: float, limit_s: float) -> bool:
    """Take ``snapshot()`` every ``quiet_s`` until two in a row are equal; False if that never happened
    within ``limit_s``.

    Why: a server answers before its write-behind has written the answer's chunks, and nothing tells a
    client when that is done; what the store holds standing still for ``quiet_s`` is the sign."""
    deadline, last = time.monotonic() + limit_s, snapshot()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = snapshot()
        if now == last:
            return True
        last = now
    return False
