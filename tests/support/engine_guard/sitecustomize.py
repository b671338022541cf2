"""Refuse to start a vLLM engine in a process launched by a test without the `engine` marker.

tests/conftest.py puts this folder on PYTHONPATH, with ``TIERCACHE_TEST_WITHOUT_ENGINE_MARKER`` naming the
test, for every test not marked `engine`; Python imports this module at start-up in every process such a
test launches (a CLI command, a job, a server). Why: `pytest -m "not engine"` (`make test-fast`) is the
fast inner loop only while every test that starts an engine says so, and `make test` hands the engine
modules out first. An engine start here fails with a message naming the test and the marker it lacks.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

#: The variable naming the test whose processes must not start an engine.
GUARD_ENV = "TIERCACHE_TEST_WITHOUT_ENGINE_MARKER"
_TEST = os.environ.get(GUARD_ENV)
#: Where every vLLM engine starts, offline or served, in-process or in its engine-core process.
_ENGINE_MODULE = "vllm.v1.engine.core"


def refusal(test: str | None) -> Callable[..., None]:
    """An `EngineCore.__init__` that fails, naming ``test`` and the marker it lacks."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(f"{test} starts a vLLM engine but is not marked `engine`: add "
                           f"`@pytest.mark.engine` (or `pytestmark = pytest.mark.engine` for its module)")

    return refuse


class _GuardEngineCore(importlib.abc.MetaPathFinder):
    """Wraps `EngineCore.__init__` when vLLM's engine-core module is loaded (a post-import hook)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _ENGINE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            module.EngineCore.__init__ = refusal(_TEST)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _TEST:
    sys.meta_path.insert(0, _GuardEngineCore())
