"""Test-suite wiring. Each fixture module belongs to one feature; see tests/fixtures/."""

pytest_plugins = [
    "tests.fixtures.redis",
    "tests.fixtures.models",
    "tests.fixtures.mm_models",
]

# tests/gpu needs CUDA and runs on its own (`make test-gpu`, scripts/gpu-check.sh, with
# --confcutdir=tests/gpu so this file is not loaded there); the main suite never collects it.
collect_ignore = ["gpu"]
