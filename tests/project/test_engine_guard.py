"""The guard that keeps `pytest -m "not engine"` fast: a test without the `engine` marker cannot start one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.engine_guard.sitecustomize import GUARD_ENV

REPO = Path(__file__).resolve().parents[2]


def test_an_unmarked_test_that_starts_an_engine_fails_naming_the_marker(tiny_llama: Path, request) -> None:
    assert os.environ[GUARD_ENV] == request.node.nodeid
    script = f"from vllm import LLM; LLM(model={str(tiny_llama)!r}, enforce_eager=True, max_model_len=256)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode != 0
    assert f"{request.node.nodeid} starts a vLLM engine but is not marked `engine`" in proc.stderr, proc.stderr[-3000:]
