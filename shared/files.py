"""Small files other processes read while we rewrite them: replaced whole, never seen half-written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def replace_json(path: str | Path, payload: Any) -> None:
    """Replace ``path`` with ``payload`` as JSON atomically (a temp file beside it, then a rename).

    Readers see the whole new file or the previous one. The temp name carries the pid, so processes that
    share a path never write into each other's temp file. Raises `OSError`: callers say what was lost.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, default=str)
    os.replace(tmp, path)
