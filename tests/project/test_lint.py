"""The code base stays `ruff` clean (the rules are in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_check_is_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "vllm_tiercache", "shared", "kvcache", "eccache", "tools", "tests"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
