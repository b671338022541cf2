"""The order `make test` hands modules to its workers: longest first, from the recorded seconds."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.support.module_order import (
    NEW_ENGINE_MODULE_SECONDS,
    ModuleSecondsRecorder,
    load_seconds,
    order_longest_first,
)


class _Item:
    def __init__(self, nodeid: str, engine: bool = False) -> None:
        self.nodeid = nodeid
        self.engine = engine

    def get_closest_marker(self, name: str) -> Any:
        return object() if name == "engine" and self.engine else None


def test_longest_modules_first_and_each_modules_tests_keep_their_order() -> None:
    items = [_Item("tests/a.py::one"), _Item("tests/a.py::two"), _Item("tests/b.py::x", engine=True),
             _Item("tests/c.py::y[1]"), _Item("tests/c.py::y[2]"), _Item("tests/new.py::z", engine=True)]
    seconds = {"tests/a.py": 5.0, "tests/b.py": 30.0, "tests/c.py": NEW_ENGINE_MODULE_SECONDS + 1}
    order_longest_first(items, seconds)  # type: ignore[arg-type]
    assert [item.nodeid for item in items] == [
        "tests/c.py::y[1]", "tests/c.py::y[2]",  # recorded, longest
        "tests/new.py::z",  # an engine module not recorded yet: counted as a typical engine module
        "tests/b.py::x", "tests/a.py::one", "tests/a.py::two"]


def test_the_recorder_sums_each_module_and_keeps_modules_this_run_did_not_see(tmp_path: Path) -> None:
    path = tmp_path / "module_seconds.json"
    path.write_text(json.dumps({"tests/serial.py": 9.0, "tests/a.py": 1.0}))
    recorder = ModuleSecondsRecorder(path)
    for nodeid, duration in (("tests/a.py::one", 1.25), ("tests/a.py::one", 0.5), ("tests/b.py::x[p]", 7.0)):
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=duration))  # type: ignore[arg-type]
    worker = SimpleNamespace(config=SimpleNamespace(workerinput={}))
    recorder.pytest_sessionfinish(worker)  # type: ignore[arg-type]  # an xdist worker writes nothing
    assert load_seconds(path) == {"tests/serial.py": 9.0, "tests/a.py": 1.0}
    recorder.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace()))  # type: ignore[arg-type]
    assert list(json.loads(path.read_text()).items()) == [
        ("tests/serial.py", 9.0), ("tests/b.py", 7.0), ("tests/a.py", 1.8)]


def test_a_missing_or_damaged_file_orders_by_the_engine_marker_alone(tmp_path: Path) -> None:
    assert load_seconds(tmp_path / "absent.json") == {}
    (tmp_path / "bad.json").write_text("[1, 2")
    assert load_seconds(tmp_path / "bad.json") == {}
    assert load_seconds(Path(__file__).parents[1] / "module_seconds.json")  # the committed file reads


def test_the_recorder_leaves_serial_tests_out(tmp_path: Path) -> None:
    """The order is pass 1's: a module's serial tests (pass 2) neither add to it nor, alone, rewrite it."""
    path = tmp_path / "module_seconds.json"
    path.write_text(json.dumps({"tests/mixed.py": 40.0}))
    recorder = ModuleSecondsRecorder(path)
    recorder.pytest_runtest_logreport(SimpleNamespace(  # type: ignore[arg-type]
        nodeid="tests/mixed.py::hangs", duration=9.0, keywords={"serial": 1, "hangs": 1}))
    recorder.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace()))  # type: ignore[arg-type]
    assert load_seconds(path) == {"tests/mixed.py": 40.0}  # nothing counted: the file is left as it was
    recorder.pytest_runtest_logreport(SimpleNamespace(  # type: ignore[arg-type]
        nodeid="tests/mixed.py::quick", duration=3.0, keywords={"quick": 1}))
    recorder.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace()))  # type: ignore[arg-type]
    assert load_seconds(path) == {"tests/mixed.py": 3.0}
