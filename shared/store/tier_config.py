"""What every tier config class builds on: `ConfigError`, size parsing and the field validators.

Why here and not in `vllm_tiercache.shared.config`: that module imports every built-in tier config module
(to re-export the classes), and those modules need these helpers; keeping the helpers in this leaf module
(standard library only) means no import cycle. `vllm_tiercache.shared.config` re-exports `ConfigError`,
`parse_size` and `default_cache_dir`, so callers keep importing them from there.

A tier config class (see `vllm_tiercache.shared.store.registry`) is a frozen dataclass whose ``kind``
defaults to its registered kind, with a ``policy`` field and a classmethod ``from_raw(raw, path)`` that
validates the raw mapping of one ``tiers[i]`` item: `check_keys` and `check_policy` first (so every tier
kind reports unknown keys and bad policies alike), then its own fields.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
    "ti": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A wrong store configuration. The message names the field path, the bad value and what is allowed."""


def invalid(path: str, value: Any, allowed: str) -> ConfigError:
    """The one error style: ``<path>: invalid value <value>; allowed: <allowed>``."""
    return ConfigError(f"{path}: invalid value {value!r}; allowed: {allowed}")


def parse_size(value: Any, path: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "500MB", "1.5GiB" (binary and decimal units)."""
    allowed = 'a non-negative int (bytes) or a string such as "8GiB", "500MB", "1.5GiB"'
    if isinstance(value, bool):
        raise invalid(path, value, allowed)
    if isinstance(value, int):
        if value < 0:
            raise invalid(path, value, allowed)
        return value
    if isinstance(value, float) and value >= 0 and math.isfinite(value):
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if math.isfinite(size):  # "1" * 400 + "GiB" overflows a float: an error, not a crash
                return int(size)
    raise invalid(path, value, allowed)


def default_cache_dir() -> Path:
    """The user's cache dir for the default disk tier ($TIERCACHE_CACHE_DIR, $XDG_CACHE_HOME, ~/.cache)."""
    if os.environ.get("TIERCACHE_CACHE_DIR"):
        return Path(os.environ["TIERCACHE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vllm-tiercache"


def env_size(name: str, default: int) -> int | str:
    """A size default that ``$name`` may override (parsed by `parse_size` with the field's path)."""
    return os.environ.get(name) or default


def as_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise invalid(path, value, "true or false")


def as_number(value: Any, path: str, *, positive: bool = True, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        if value > 0 or (not positive and value >= 0):
            return float(value)
    allowed = "a positive number of seconds" + (" or null" if optional else "")
    raise invalid(path, value, allowed)


def as_int(value: Any, path: str, allowed: str, ok: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and ok(value):
        return value
    raise invalid(path, value, allowed)


def as_str(value: Any, path: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, str) and value:
        return value
    raise invalid(path, value, "a non-empty string" + (" or null" if optional else ""))


def check_keys(raw: Mapping[str, Any], path: str, kind: str, known: Sequence[str], *,
               prefix: str | None = None, prefix_hint: str = "") -> None:
    """Every key of ``raw`` is in ``known`` (or starts with ``prefix``): typos must not be silently ignored."""
    for name in raw:
        if name not in known and not (prefix and isinstance(name, str) and name.startswith(prefix)):
            raise ConfigError(f"{path}.{name}: unknown key for a {kind} tier; known keys: "
                              f"{', '.join(known)}{prefix_hint}")


def check_policy(raw: Mapping[str, Any], path: str, policies: Sequence[str]) -> str:
    """The tier's eviction policy (default "lru"), one of ``policies``."""
    policy = raw.get("policy", "lru")
    if policy not in policies:
        raise invalid(f"{path}.policy", policy, ", ".join(policies))
    return policy
