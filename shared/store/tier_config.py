"""What every config section builds on: `ConfigError`, sizes, the field types and `validate`.

A config section (the store, a tier kind, a connector's options) is a frozen dataclass whose fields carry
their whole definition in the annotation: type, bounds, default, description (``Field``) and what an
error says is allowed (`Allowed`). Pydantic validates a raw mapping against it (`validate`) and writes its
JSON schema (`vllm_tiercache.shared.config_schema`); the dataclass stays what the code reads (built
without validation when code constructs one directly, as the tests and the tiers do).

Why here and not in `vllm_tiercache.shared.config`: that module imports every built-in tier config module,
and those need these helpers; this leaf module (standard library and pydantic only) means no import cycle.
`vllm_tiercache.shared.config` re-exports `ConfigError`, `parse_size` and `default_cache_dir`.

Errors: `validate` turns pydantic's first error into one line, ``<path>: invalid value <value>; allowed:
<allowed>``, the path built from the field's location (``tiers[1].capacity``). Unknown keys are checked
first, by `check_keys`, which names the nearest known key.

Bounds: every size is at most `MAX_SIZE` (1 EiB: beyond it a number is a typo, not a cache), a tier's
capacity at least `MIN_CAPACITY` (a smaller tier holds no record and would refuse every put without a
word), and every duration is finite and within the bounds its field gives `seconds`.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

from pydantic import BeforeValidator, Field, Strict, TypeAdapter, ValidationError, WithJsonSchema
from pydantic_core import PydanticCustomError

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
SIZE_ALLOWED = 'a non-negative int (bytes) or a string such as "8GiB", "500MB", "1.5GiB", at most 1EiB'


class ConfigError(ValueError):
    """A wrong store configuration. The message names the field path, the bad value and what is allowed."""


def invalid(path: str, value: Any, allowed: str) -> ConfigError:
    """The one error style: ``<path>: invalid value <value>; allowed: <allowed>``."""
    return ConfigError(f"{path}: invalid value {value!r}; allowed: {allowed}")


def _bytes(value: Any) -> int | None:
    """Bytes from an int or a size string, None when it is neither or beyond `MAX_SIZE`."""
    size: int | float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    # a NaN fails both comparisons; "1" * 400 + "GiB" overflows a float to inf: an error, not a crash
    return int(size) if size is not None and 0 <= size <= MAX_SIZE else None


def parse_size(value: Any, path: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "500MB", "1.5GiB" (binary and decimal units), at most
    `MAX_SIZE`; fractions of a byte are dropped ("1.5B" is 1)."""
    size = _bytes(value)
    if size is None:
        raise invalid(path, value, SIZE_ALLOWED)
    return size


def default_cache_dir() -> Path:
    """The user's cache dir for the default disk tier ($TIERCACHE_CACHE_DIR, $XDG_CACHE_HOME, ~/.cache)."""
    if os.environ.get("TIERCACHE_CACHE_DIR"):
        return Path(os.environ["TIERCACHE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vllm-tiercache"


# ------------------------------------------------------------------------------------ field metadata
@dataclass(frozen=True)
class Allowed:
    """Annotation metadata: what an error about this field says is allowed (``path`` replaces the field
    path in the message, for a key better named with its setting, e.g. ``kv_connector_extra_config.x``)."""

    text: str
    path: str | None = None


@dataclass(frozen=True)
class EnvDefault:
    """Annotation metadata: when the key is missing, the value of ``$env`` (if set) is validated in its
    place, and errors and warnings about it name the variable: ``tiers[0].capacity ($ENV)``."""

    env: str


def fail(allowed: str, shown: Any = None) -> PydanticCustomError:
    """The error a custom validator raises: what is allowed (``shown``: the value as the message shows it,
    e.g. a URL without its password)."""
    ctx: dict[str, Any] = {"allowed": allowed}
    if shown is not None:
        ctx["shown"] = shown
    return PydanticCustomError("tiercache", "{allowed}", ctx)


# --------------------------------------------------------------------------------------- field types
#: true or false, nothing else (pydantic's lax mode would take "yes" and 1)
Bool = Annotated[bool, Strict(), Allowed("true or false")]
#: a non-empty string
Text = Annotated[str, Strict(), Field(min_length=1), Allowed("a non-empty string")]
#: a non-empty string, or null
OptionalText = Annotated[Annotated[str, Strict(), Field(min_length=1)] | None, Allowed("a non-empty string or null")]


def size(minimum: int = 0, maximum: int = MAX_SIZE, out_of_range: str = "") -> Any:
    """A size field: an int (bytes) or a string such as "8GiB", validated to an int in [minimum, maximum]
    (``out_of_range``: what the error says when a well-formed size is outside)."""

    def to_bytes(value: Any) -> int:
        got = _bytes(value)
        if got is None:
            raise fail(SIZE_ALLOWED)
        if not minimum <= got <= maximum:
            raise fail(out_of_range)
        return got

    schema = {"anyOf": [{"type": "integer", "minimum": minimum, "maximum": maximum},
                        {"type": "string", "pattern": _SIZE_RE.pattern}], "format": "size"}
    return Annotated[int, BeforeValidator(to_bytes), WithJsonSchema(schema)]


#: a tier's capacity: a size of at least `MIN_CAPACITY` bytes
Capacity = size(MIN_CAPACITY, out_of_range=f'a size of at least {MIN_CAPACITY} bytes, e.g. "2GiB" (a smaller tier '
                                           "holds no record: every put would be refused)")


#: The most of a tier's capacity pins may hold: a tier all pinned could keep nothing new.
MAX_PIN_BUDGET = 0.9
#: a tier's ``pin_budget``: the share of its capacity that pinned records may hold (0: no pins)
PinBudget = Annotated[float, Strict(), Field(ge=0.0, le=MAX_PIN_BUDGET, allow_inf_nan=False, description=(
    "Share of the tier's capacity that pinned records (`tiercache pin --tag`, `precompute ... --pin`) may hold, "
    f"0.0 to {MAX_PIN_BUDGET:g}. 0 (the default): no pins; `tiercache pin` is refused and names this key. "
    "Eviction never drops a pinned record while unpinned ones remain (docs/operations.md, pins).")),
    Allowed(f"a share of the tier's capacity from 0.0 to {MAX_PIN_BUDGET:g} (0: no pins), e.g. 0.2")]


def seconds(*, minimum: float | None = None, maximum: float | None = None, positive: bool = True,
            optional: bool = False, null_means: str = "") -> Any:
    """A finite number of seconds: > 0 (``positive``) or >= 0, within [``minimum``, ``maximum``] when given;
    null too when ``optional`` (``null_means`` says what null does, for the message). Ints are taken."""
    allowed = "a positive number of seconds" if positive else "a number of seconds, 0 or more"
    allowed += f", at least {minimum:g}" if minimum is not None else ""
    allowed += f", at most {maximum:g}" if maximum is not None else ""
    allowed += f", or null{f' ({null_means})' if null_means else ''}" if optional else ""
    low = {"ge": minimum} if minimum is not None else {"gt": 0} if positive else {"ge": 0}
    number = Annotated[float, Strict(), Field(allow_inf_nan=False, le=maximum, **low)]
    return Annotated[number | None if optional else number, Allowed(allowed)]  # type: ignore[operator]


# ------------------------------------------------------------------------------------------ validate
def validate(cls: Any, raw: Mapping[str, Any], path: str = "", defaults: Mapping[str, Any] | None = None) -> Any:
    """An instance of the section ``cls`` (a dataclass or TypedDict with annotated fields) from ``raw``:
    ``defaults`` fill missing keys (a default that depends on the environment), then `EnvDefault` fields
    their variable; pydantic's first error becomes a `ConfigError` named from ``path`` (e.g. "tiers[1]")."""
    data = {**(defaults or {}), **raw}
    labels: dict[str, str] = {}
    for name, env in _env_defaults(cls).items():
        if name not in raw and os.environ.get(env):
            data[name] = os.environ[env]
            labels[name] = field_path(cls, raw, "", name)
    try:
        return _adapter(cls).validate_python(data)
    except ValidationError as exc:
        raise _config_error(cls, exc.errors()[0], path, labels) from None


def field_path(cls: Any, raw: Mapping[str, Any], path: str, name: str) -> str:
    """``path.name`` as errors name it: with ``($ENV)`` when the value came from the field's variable."""
    env = _env_defaults(cls).get(name)
    label = f"{name} (${env})" if env and name not in raw and os.environ.get(env) else name
    return f"{path}.{label}" if path else label


@cache
def _adapter(cls: Any) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def section_schema(cls: Any) -> dict[str, Any]:
    """The JSON schema of one config section (see `vllm_tiercache.shared.config_schema`)."""
    return _adapter(cls).json_schema()


@cache
def _metadata(cls: Any) -> dict[str, tuple[Any, list[Any]]]:
    """field (by key, i.e. alias) -> (its type without Annotated, its Annotated metadata)."""
    hints = get_type_hints(cls, include_extras=True)
    out: dict[str, tuple[Any, list[Any]]] = {}
    for name, hint in hints.items():
        meta = list(getattr(hint, "__metadata__", ()))
        base = get_args(hint)[0] if meta else hint
        alias = next((m.alias for m in meta if getattr(m, "alias", None)), None)
        out[alias or name] = (base, meta)
    return out


def _env_defaults(cls: Any) -> dict[str, str]:
    return {name: m.env for name, (_, meta) in _metadata(cls).items() for m in meta if isinstance(m, EnvDefault)}


def _config_error(cls: Any, err: Mapping[str, Any], path: str, labels: Mapping[str, str]) -> ConfigError:
    """One pydantic error as a `ConfigError` in the one style."""
    ctx = err.get("ctx") or {}
    if isinstance(ctx.get("error"), ConfigError):  # a validator that knew the whole message (a tier's)
        return ctx["error"]
    loc = list(err["loc"])
    name = loc[0] if loc else ""
    base, meta = _metadata(cls).get(name, (None, []))
    allowed = next((m for m in reversed(meta) if isinstance(m, Allowed)), None)
    where = allowed.path if allowed and allowed.path else labels.get(name, str(name))
    where = f"{path}.{where}" if path and where else path or where
    for part in loc[1:]:
        where += f"[{part}]" if isinstance(part, int) else f".{part}"
    if err["type"] == "tiercache":
        text = ctx["allowed"]
    elif allowed is not None:
        text = allowed.text
    elif get_origin(base) is Literal:
        text = ", ".join(str(v) for v in get_args(base))
    else:
        text = err["msg"]
    value = None if err["type"] == "missing" else ctx.get("shown", err["input"])
    return invalid(where, value, text)


# -------------------------------------------------------------------------------------- key checks
def did_you_mean(name: Any, known: Sequence[Any]) -> str:
    """``"did you mean 'capacity'? "`` for the known name nearest ``name`` (difflib), or ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, [k for k in known if isinstance(k, str)], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def section_keys(cls: Any, exclude: Sequence[str] = ()) -> tuple[str, ...]:
    """The keys a section's mapping may have: its dataclass fields, ``kind`` first (a tier's)."""
    names = [f.name for f in fields(cls) if f.name not in exclude] if is_dataclass(cls) else list(_metadata(cls))
    return tuple(sorted(names, key=lambda n: n != "kind"))


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
    """The tier's eviction policy (default "lru"), one of ``policies`` (for a tier kind registered without
    a pydantic section; the built-in kinds declare ``policy`` as a Literal)."""
    policy = raw.get("policy", "lru")
    if policy not in policies:
        raise invalid(f"{path}.policy", policy, ", ".join(policies))
    return policy


def as_str(value: Any, path: str, *, optional: bool = False) -> str | None:
    """A non-empty string (or None for null when ``optional``), for a section written by hand."""
    if value is None and optional:
        return None
    if isinstance(value, str) and value:
        return value
    raise invalid(path, value, "a non-empty string" + (" or null" if optional else ""))


def schema_extra(*, drop: Sequence[str] = (), required: Sequence[str] = (), no_default: Sequence[str] = (),
                 **extra: Any) -> Callable[[dict[str, Any]], None]:
    """A ``json_schema_extra`` for a section whose keys differ from its fields: ``drop`` fields that are
    not keys, mark keys ``required`` that the dataclass defaults (for direct construction), show
    ``no_default`` for a default the environment decides (the description says it), add ``extra``."""

    def edit(schema: dict[str, Any]) -> None:
        props = schema.get("properties", {})
        for name in drop:
            props.pop(name, None)
        for name in (*required, *no_default):
            props.get(name, {}).pop("default", None)
        if required:
            schema["required"] = [*schema.get("required", []), *required]
        schema.update(extra)

    return edit


def format_bytes(n: int) -> str:
    """``"1.5 GiB"``: a size for log lines and messages."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
