"""Test-suite wiring. Each fixture module belongs to one feature; see tests/fixtures/."""

pytest_plugins = [
    "tests.fixtures.redis",
    "tests.fixtures.models",
    "tests.fixtures.mm_models",
]
