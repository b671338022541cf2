"""Longest modules first: the order in which `make test` hands whole modules to its xdist workers.

Why: `scripts/run_tests.sh` gives each worker whole modules (`--dist loadscope`) in collection order. The
suite's wall time is set by whichever worker finishes last, and one module (`bench serve`, several
servers one after another) takes as long as forty small ones. Handed out longest first, the long
modules run side by side from the start and the short ones fill the gaps at the end; handed out in
file order, a long module that happens to sort late runs alone while the other workers idle.

How long a module takes is read from `tests/module_seconds.json`, the seconds each module spent on its
worker (setup, call and teardown of its tests) in a recorded run. A module not in the file (a new one)
counts as `NEW_ENGINE_MODULE_SECONDS` when it has engine tests and as nothing otherwise, so it is still
placed sensibly until the file is refreshed: `TIERCACHE_RECORD_MODULE_SECONDS=1 make test` rewrites it
from that run. The order changes no result, only which worker runs a module when.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).resolve().parents[1] / "module_seconds.json"
RECORD_ENV = "TIERCACHE_RECORD_MODULE_SECONDS"
#: What an engine module not yet in the file is assumed to take: about one engine start and a few tests.
NEW_ENGINE_MODULE_SECONDS = 120.0


def module_path(nodeid: str) -> str:
    """`tests/kv/load/test_load.py` from `tests/kv/load/test_load.py::test_x[param]`."""
    return nodeid.split("::", 1)[0]


def load_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """The recorded seconds per module; an absent or unreadable file orders by the engine marker alone."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(name): float(value) for name, value in data.items() if isinstance(value, int | float)}


def order_longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Sort `items` in place: modules by expected seconds, longest first; a module's tests keep their order."""
    engine_modules = {module_path(item.nodeid) for item in items if item.get_closest_marker("engine")}

    def expected(module: str) -> float:
        if module in seconds:
            return seconds[module]
        return NEW_ENGINE_MODULE_SECONDS if module in engine_modules else 0.0

    # stable: within a module (and between modules of equal cost) pytest's own order stays
    items.sort(key=lambda item: -expected(module_path(item.nodeid)))


class ModuleSecondsRecorder:
    """Adds up each module's test durations in the controlling process and writes them when the run ends.

    Under xdist every worker's reports reach the controller, so the sums are per module whichever worker
    ran it. Modules this run did not collect keep their recorded value. Tests marked ``serial`` are not
    counted: the order is pass 1's, where they do not run, and pass 2 (serial tests only) used to rewrite a
    module that has both kinds with its serial tests' seconds alone, so that pass 1 placed it by them.
    """

    def __init__(self, path: Path = SECONDS_FILE) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "serial" in getattr(report, "keywords", {}):
            return
        self.seconds[module_path(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput") or not self.seconds:
            return  # an xdist worker: its controller writes the sums
        merged = {**load_seconds(self.path), **{name: round(value, 1) for name, value in self.seconds.items()}}
        ordered = dict(sorted(merged.items(), key=lambda kv: (-kv[1], kv[0])))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n")


def recording_requested() -> bool:
    return os.environ.get(RECORD_ENV, "") not in ("", "0")
