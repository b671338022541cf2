"""Test-suite wiring. Each fixture module belongs to one feature; see tests/fixtures/."""

import pytest

pytest_plugins = [
    "tests.fixtures.redis",
    "tests.fixtures.models",
    "tests.fixtures.mm_models",
]

# tests/gpu needs CUDA and runs on its own (`make test-gpu`, scripts/gpu-check.sh, with
# --confcutdir=tests/gpu so this file is not loaded there); the main suite never collects it.
collect_ignore = ["gpu"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with engine tests first, each module's tests kept together and in order.

    Why: `make test` hands whole modules to its xdist workers in this order (scripts/run_tests.sh), and
    the engine modules take minutes each; started first, they spread over the workers instead of one
    worker finishing the last of them while the other idles. The sort is stable, so pytest's own
    grouping by fixture within a module stays as it was.
    """
    engine_modules = {item.module.__name__ for item in items if item.get_closest_marker("engine") and item.module}
    items.sort(key=lambda item: (item.module.__name__ if item.module else "") not in engine_modules)
