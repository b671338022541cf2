"""What every tier config class builds on: `ConfigError`, size parsing and the field validators.

Why here and not in `vllm_tiercache.shared.config`: that module imports every built-in tier config module
(to re-export the classes), and those modules need these helpers; keeping the helpers in this leaf module
(standard library only) means no import cycle. `vllm_tiercache.shared.config` re-exports `ConfigError`,
`parse_size` and `default_cache_dir`, so callers keep importing them from there.

A tier config class (see `vllm_tiercache.shared.store.registry`) is a frozen dataclass whose ``kind``
defaults to its registered kind, with a ``policy`` field and a classmethod ``from_raw(raw, path)`` that
validates the raw mapping of one ``tiers[i]`` item: `check_keys` and `check_policy` first (so every tier
kind reports unknown keys and bad policies alike), then its own fields.

Bounds: every size is at most `MAX_SIZE` (1 EiB: beyond it a number is a typo, not a cache), a tier's
capacity at least `MIN_CAPACITY` (`parse_capacity`: a smaller tier holds no record and would refuse every
put without a word), and every duration is finite and within the bounds its field gives `as_number`.
"""

from __future__ import annotations

import difflib
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
    "p": 1000**5, "pb": 1000**5, "pi": 1 << 50, "pib": 1 << 50,
    "e": 1000**6, "eb": 1000**6, "ei": 1 << 60, "eib": 1 << 60,
}
#: The largest size any field accepts (1 EiB): a bigger number is a typo, not a cache.
MAX_SIZE = 1 << 60
#: The smallest capacity of a memory or disk tier. A record on disk is at least 129 bytes (its header
#: alone is 128); a tier smaller than this holds nothing and would refuse every put, silently.
MIN_CAPACITY = 256
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A wrong store configuration. The message names the field path, the bad value and what is allowed."""


def invalid(path: str, value: Any, allowed: str) -> ConfigError:
    """The one error style: ``<path>: invalid value <value>; allowed: <allowed>``."""
    return ConfigError(f"{path}: invalid value {value!r}; allowed: {allowed}")


def parse_size(value: Any, path: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "500MB", "1.5GiB" (binary and decimal units), at most
    `MAX_SIZE`; fractions of a byte are dropped ("1.5B" is 1)."""
    allowed = 'a non-negative int (bytes) or a string such as "8GiB", "500MB", "1.5GiB", at most 1EiB'
    size: int | float | None = None
    if isinstance(value, bool):
        size = None
    elif isinstance(value, (int, float)):
        size = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    # a NaN fails both comparisons; "1" * 400 + "GiB" overflows a float to inf: an error, not a crash
    if size is None or not 0 <= size <= MAX_SIZE:
        raise invalid(path, value, allowed)
    return int(size)


def parse_capacity(value: Any, path: str, minimum: int = MIN_CAPACITY) -> int:
    """A tier's capacity: a size (`parse_size`) of at least ``minimum`` bytes.

    Why a minimum: a tier of capacity 0 (or "0.0001B", which is 0) refuses every put and logs nothing, so
    a typo would turn a cache off without a trace.
    """
    size = parse_size(value, path)
    if size < minimum:
        raise invalid(path, value, f"a size of at least {minimum} bytes, e.g. \"2GiB\" (a smaller tier holds "
                                   "no record: every put would be refused)")
    return size


def default_cache_dir() -> Path:
    """The user's cache dir for the default disk tier ($TIERCACHE_CACHE_DIR, $XDG_CACHE_HOME, ~/.cache)."""
    if os.environ.get("TIERCACHE_CACHE_DIR"):
        return Path(os.environ["TIERCACHE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vllm-tiercache"


def capacity_option(raw: Mapping[str, Any], path: str, env: str, default: int) -> tuple[int, str]:
    """(capacity, its field path) of one ``tiers[i]`` item: ``capacity``, else ``$env``, else ``default``,
    checked by `parse_capacity`. The field path names ``$env`` when the value came from it, so an error or a
    warning about it points at the variable, not at a key the user never wrote."""
    field = f"{path}.capacity"
    if "capacity" in raw:
        value = raw["capacity"]
    else:
        value = os.environ.get(env) or default
        if os.environ.get(env):
            field += f" (${env})"
    return parse_capacity(value, field, MIN_CAPACITY), field


def as_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise invalid(path, value, "true or false")


def as_number(value: Any, path: str, *, positive: bool = True, optional: bool = False,
              minimum: float | None = None, maximum: float | None = None, null_means: str = "") -> float | None:
    """A finite number of seconds: > 0 (``positive``) or >= 0, within [``minimum``, ``maximum``] when given;
    None for null when ``optional`` (``null_means`` says what null does, for the message)."""
    if value is None and optional:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value):
        ok = value > 0 if positive else value >= 0
        ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
        if ok:
            return float(value)
    allowed = "a positive number of seconds" if positive else "a number of seconds, 0 or more"
    if minimum is not None:
        allowed += f", at least {minimum:g}"
    if maximum is not None:
        allowed += f", at most {maximum:g}"
    if optional:
        allowed += f", or null{f' ({null_means})' if null_means else ''}"
    raise invalid(path, value, allowed)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


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


def did_you_mean(name: Any, known: Sequence[Any]) -> str:
    """``"did you mean 'capacity'? "`` for the known name nearest ``name`` (difflib), or ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, [k for k in known if isinstance(k, str)], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def check_keys(raw: Mapping[str, Any], path: str, kind: str, known: Sequence[str], *,
               prefix: str | None = None, prefix_hint: str = "", prefixed: Sequence[str] | None = None) -> None:
    """Every key of ``raw`` is in ``known`` (or starts with ``prefix``): typos must not be silently ignored.

    The message suggests the nearest known key. ``prefixed``, when given, lists the keys with ``prefix``
    that are valid (e.g. redis-py's ``ssl_*`` options); any other key with the prefix is unknown too.
    """
    for name in raw:
        if name in known:
            continue
        if prefix and isinstance(name, str) and name.startswith(prefix) and (prefixed is None or name in prefixed):
            continue
        raise ConfigError(f"{path}.{name}: unknown key for a {kind} tier; "
                          f"{did_you_mean(name, [*known, *(prefixed or ())])}known keys: "
                          f"{', '.join(known)}{prefix_hint}")


def check_policy(raw: Mapping[str, Any], path: str, policies: Sequence[str]) -> str:
    """The tier's eviction policy (default "lru"), one of ``policies``."""
    policy = raw.get("policy", "lru")
    if policy not in policies:
        raise invalid(f"{path}.policy", policy, ", ".join(policies))
    return policy


def format_bytes(n: int) -> str:
    """``"1.5 GiB"``: a size for log lines and messages."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
