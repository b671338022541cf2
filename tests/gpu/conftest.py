"""The GPU suite (`make test-gpu`, scripts/gpu-check.sh): needs CUDA and torch, never vLLM.

Run with ``--confcutdir=tests/gpu`` so the main suite's conftest (vLLM models, Redis) is not loaded; the
main suite in turn never collects this folder (tests/conftest.py). Without a CUDA device the session stops
at once with a non-zero status: this suite never "passes" where it did not run.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():
        pytest.exit("tests/gpu needs a CUDA device and torch.cuda.is_available() is False here; run it on a "
                    "machine with an NVIDIA GPU (scripts/gpu-check.sh)", returncode=3)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
