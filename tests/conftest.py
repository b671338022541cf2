"""Test-suite wiring. Each fixture module belongs to one feature; see tests/fixtures/."""

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Before anything loads OpenMP (torch): every engine, server and job the suite starts inherits it.
# vLLM's CPU worker pins its OpenMP threads to every core (GOMP_CPU_AFFINITY) and OpenMP's default wait
# policy spins; with two test engines on a 2-core machine, each one's waiting threads spin on the cores the
# other needs. Measured on one test beside one busy core: 210 s spinning, 15 s passive. Passive waiting
# changes no result: the same threads sum in the same order.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# vLLM names the ZMQ sockets between an engine's processes in $VLLM_RPC_BASE_PATH (default: the temp dir) and
# leaves them when the engine is killed or stopped: about 360 in /tmp per run of this suite. Every engine the
# suite starts inherits a directory of this process's own instead, removed at its end.
if "VLLM_RPC_BASE_PATH" not in os.environ:
    _RPC_DIR = tempfile.mkdtemp(prefix="tc-ipc-")  # short: a unix socket's path is at most 107 bytes
    os.environ["VLLM_RPC_BASE_PATH"] = _RPC_DIR
    atexit.register(shutil.rmtree, _RPC_DIR, ignore_errors=True)

import pytest

from tests.support import thread_guard
from tests.support.engine_guard.sitecustomize import GUARD_ENV, refusal
from tests.support.module_order import ModuleSecondsRecorder, load_seconds, order_longest_first, recording_requested
from tests.support.zygote_client import zygote_subprocess
from vllm_tiercache.tools.demo import server as demo_server

# The OpenAI servers the tests start (`tools/demo/server.py`'s `Server`) fork their front end from this
# process's engine zygote instead of importing vLLM afresh; vLLM still spawns their EngineCore and worker.
# Set here, once, because servers start in module-scoped fixtures, before any per-test fixture could.
demo_server.subprocess = zygote_subprocess()  # type: ignore[assignment]

pytest_plugins = [
    "tests.fixtures.redis",
    "tests.fixtures.s3",
    "tests.fixtures.models",
    "tests.fixtures.mm_models",
]

# tests/gpu needs CUDA and runs on its own (`make test-gpu`, scripts/gpu-check.sh, with
# --confcutdir=tests/gpu so this file is not loaded there); the main suite never collects it.
collect_ignore = ["gpu"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (tests/support/module_order.py says why), each module's tests kept together."""
    order_longest_first(items, load_seconds())


def pytest_configure(config: pytest.Config) -> None:
    if recording_requested():
        config.pluginmanager.register(ModuleSecondsRecorder(), "tiercache-module-seconds")


_ENGINE_GUARD_DIR = str(Path(__file__).parent / "support" / "engine_guard")


@pytest.fixture(autouse=True)
def _engine_marker_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test without the `engine` marker may not start a vLLM engine (tests/support/engine_guard says why).

    Its child processes get the guard through PYTHONPATH (a launcher that replaces PYTHONPATH instead of
    extending it escapes it); in this process, vLLM's `EngineCore` is guarded when vLLM is loaded already.
    """
    if request.node.get_closest_marker("engine"):
        return
    monkeypatch.setenv(GUARD_ENV, request.node.nodeid)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [_ENGINE_GUARD_DIR, os.environ.get("PYTHONPATH")])))
    core = sys.modules.get("vllm.v1.engine.core")
    if core is not None:
        monkeypatch.setattr(core.EngineCore, "__init__", refusal(request.node.nodeid))


@pytest.fixture(scope="module", autouse=True)
def _no_thread_outlives_its_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module's tests and fixtures must close every store and tier they open: a product thread
    (``tiercache-...``) they started and left running fails the module (tests/support/thread_guard.py says
    why). Module-scoped and autouse, from the top conftest: set up before the module's other module-scoped
    fixtures, so torn down after them (a module's shared store is closed by then)."""
    before = thread_guard.product_threads()
    yield
    if left := thread_guard.outliving(before):
        pytest.fail(f"{request.node.nodeid} left {len(left)} tiercache thread(s) running after its tests and "
                    f"fixtures ended: {thread_guard.describe(left)}. Close the stores, tiers and connectors the "
                    "tests open (store.close(), tier.close(), connector.shutdown()).", pytrace=False)
