"""No thread of ours outlives the module whose tests started it (tests/conftest.py runs this per module).

Every thread the product starts is named ``tiercache-...`` (`vllm_tiercache.shared.threads`'s
`background_thread`, and the thread pools of the object tier, the demotion and LoRA digests). A store or tier
a test does not close keeps its threads: an object tier's janitor, for one, polled the session's SeaweedFS
after the session had stopped it, and its warning then went to pytest's closed capture stream (a
``--- Logging error ---`` after the last test of a passing run). Threads still ending when the module's
fixtures are torn down (a pool finishing its last call, a janitor's last ledger write) get `GRACE_S`.
"""

from __future__ import annotations

import threading
import time

PREFIX = "tiercache-"
#: not a product thread: a zygote job's watch on its parent (tests/support/spawned_from_zygote.py)
NOT_OURS = frozenset({"tiercache-end-with-parent"})
#: how long a thread that was asked to stop may take to end. A minute, not seconds: a remote tier's lookup
#: thread ends once its call in flight returns, and a loaded run (load 15 on 2 cores) once took past 10 s to
#: end a cold lookup through `bench lookups`' delaying proxy; a thread that never ends fails all the same
GRACE_S = 60.0


def product_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate()
            if t.is_alive() and t.name.startswith(PREFIX) and t.name not in NOT_OURS}


def outliving(before: set[threading.Thread], grace_s: float = GRACE_S) -> list[threading.Thread]:
    """The product threads alive now that were not in ``before``, after waiting up to ``grace_s`` for them."""
    deadline = time.monotonic() + grace_s
    while (left := product_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(left, key=lambda t: t.name)


def describe(threads: list[threading.Thread]) -> str:
    names: dict[str, int] = {}
    for t in threads:
        names[t.name] = names.get(t.name, 0) + 1
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in names.items())
