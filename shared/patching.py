"""Run our code after a method of vLLM's, where vLLM offers no hook: one wrapper per method and process.

Used for the settings check after ``EngineArgs.create_engine_config`` (`vllm_tiercache.preflight`) and
for the EC connector's reset after ``Scheduler.reset_encoder_cache``
(`vllm_tiercache.eccache.encoder_reset`). The wrapper carries the caller's mark, so installing twice (vLLM
loads plugins more than once per process) wraps once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def call_after(owner: Any, name: str, after: Callable[[Any, Any], None], mark: str) -> bool:
    """Make ``owner.name(self, ...)`` call ``after(self, result)`` once the original returned, then return
    its result (``after`` may raise: the call then raises). The wrapper carries the attribute ``mark``
    (True); a method already marked is left as it is. False when ``owner`` has no such method."""
    original = getattr(owner, name, None)
    if original is None:
        return False
    if getattr(original, mark, False):
        return True

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after(self, result)
        return result

    setattr(wrapper, mark, True)
    setattr(owner, name, wrapper)
    return True
