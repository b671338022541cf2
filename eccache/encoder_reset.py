"""Make vLLM's encoder-cache reset reach `TieredECConnector`: stale encoder outputs after a weight update.

Why: vLLM 0.32 resets its encoder cache when the weights change in place
(``Scheduler.reset_encoder_cache``: "called when model weights are updated to ensure stale vision
embeddings computed with old weights are not reused"; ``pause_generation(clear_cache=True)``, sleep level
1+, ``LLMEngine.reset_encoder_cache``), but its EC connector interface has no reset hook, so our store
would go on serving encoder outputs of the old weights. `install` wraps that scheduler method once per
process: after vLLM's own reset it calls ``reset_cache()`` of the scheduler's EC connector when the
connector has one (ours starts a new weights generation: `vllm_tiercache.shared.generations`).

Where: the engine-core process, where the scheduler runs. The plugin's `register` installs it when
vLLM's scheduler module is already imported there (vLLM loads plugins once per process, possibly before
that import), and `TieredECConnector` installs it when vLLM's scheduler builds it: that is always the
right process, so no process imports the scheduler module for us.

Never breaks vLLM: a vLLM without the method or the attribute is left as it is, with one line in the log,
and a reset that raises is logged (vLLM's own reset has happened by then).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from vllm_tiercache.shared.patching import call_after

logger = logging.getLogger(__name__)

#: Where vLLM (0.32, 0.33) defines `Scheduler` (`AsyncScheduler` subclasses it). Kept here rather than in
#: `vllm_tiercache.shared.vllm_compat`, which imports vLLM's connector modules: the plugin loads this
#: module in every vLLM process, and only the engine core needs more.
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"

_MARK = "_vllm_tiercache_encoder_reset"
_warned: set[str] = set()


def _warn_once(what: str, message: str, *args: Any) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(message, *args)


def install(import_vllm: bool = False) -> bool:
    """Make ``Scheduler.reset_encoder_cache`` also reset the EC connector (once per process).

    Without ``import_vllm`` only where vLLM's scheduler module is imported already. Returns whether
    the wrapper is in place.
    """
    module = sys.modules.get(SCHEDULER_MODULE)
    if module is None and import_vllm:
        try:
            module = __import__(SCHEDULER_MODULE, fromlist=["Scheduler"])
        except Exception as exc:  # a broken or different vLLM: never break its start
            _warn_once("import", "vllm-tiercache: encoder-cache resets will not reach TieredECConnector: %s", exc)
            return False
    if call_after(getattr(module, "Scheduler", None), "reset_encoder_cache",
                  lambda scheduler, _result: reset_ec_connector(scheduler), _MARK):
        return True
    if module is not None:
        _warn_once("method", "vllm-tiercache: this vLLM's Scheduler has no reset_encoder_cache; encoder "
                   "records are not renamed after an in-place weight update (restart to change weights)")
    return False


def reset_ec_connector(scheduler: Any) -> bool:
    """Call ``reset_cache()`` of `scheduler`'s EC connector if it has one; whether it was called."""
    from vllm_tiercache.shared.vllm_compat import scheduler_ec_connector

    try:
        connector = scheduler_ec_connector(scheduler)
    except AttributeError as exc:
        _warn_once("attribute", "vllm-tiercache: cannot find the scheduler's EC connector (%s); encoder records "
                   "are not renamed after an in-place weight update", exc)
        return False
    reset = getattr(connector, "reset_cache", None)
    if not callable(reset):
        return False
    try:
        reset()
    except Exception:  # vLLM's own reset is done; say loudly that ours is not
        logger.exception("vllm-tiercache: the EC connector's reset_cache failed: it may serve encoder outputs "
                         "of the weights before the update")
        return False
    return True
