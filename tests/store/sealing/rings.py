"""Test helpers: key rings written as a serving process reads them (a JSON file, or an env var)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any


def new_key() -> str:
    """A fresh key as a ring holds it (base64 of 32 random bytes)."""
    return base64.b64encode(os.urandom(32)).decode()


def write_ring(path: Path, current: str, keys: dict[str, str], retired: list[str] | None = None) -> Path:
    """Write a ring file (owner-only) and return its path."""
    body: dict[str, Any] = {"current": current, "keys": keys}
    if retired:
        body["retired"] = retired
    path.write_text(json.dumps(body))
    path.chmod(0o600)
    return path


def shares_window(secret: bytes, haystack: bytes, width: int = 64) -> bool:
    """Whether some ``width``-byte window of ``secret`` (at any offset) appears anywhere in ``haystack``.

    Any such occurrence fully contains one ``width // 2``-byte block of ``haystack`` that starts at a
    multiple of ``width // 2``; so the haystack's aligned blocks are indexed once, every offset of the secret
    is looked up, and each candidate is confirmed with the full window.
    """
    half = width // 2
    blocks = {haystack[i:i + half] for i in range(0, len(haystack) - half + 1, half)}
    for j in range(0, len(secret) - half + 1):
        if secret[j:j + half] in blocks:
            lo = max(0, j - half)
            for start in range(lo, min(j, len(secret) - width) + 1):
                if secret[start:start + width] in haystack:
                    return True
    return False
