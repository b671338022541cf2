"""The key ring: key id -> 32-byte AES-256 key, one id current, retired ids listed.

Why a ring and not one key: records outlive a key. Each sealed record names the id it was sealed under
(`sealer`), so after a rotation (a new current id) the records of the old key still open while the old key
stays in ``keys``; listing an id under ``retired`` (and dropping its key) turns its records into misses,
which `tiercache evict --key-id` then reclaims.

Why the errors never show a value: the ring's contents are secrets. A ring that cannot be read or parsed
is refused with one `ConfigError` line naming the setting (``encryption.ring``), the source and the fix,
never a key or the ring's text.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_tiercache.shared.store.sealing.config import ENV_PREFIX
from vllm_tiercache.shared.store.tier_config import ConfigError

#: Bytes of every key of the ring (AES-256).
KEY_BYTES = 32
#: What a key id may be: it is stored in every sealed record's header and as one of its tags.
KEY_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
SETTING = "encryption.ring"
_FORMAT = ('a JSON object {"current": "<id>", "keys": {"<id>": "<base64 of 32 random bytes>"}, '
           '"retired": ["<id>"]}; ids of letters, digits, ".", "_", "-" (at most 64); make a key with '
           "`python -c \"import os, base64; print(base64.b64encode(os.urandom(32)).decode())\"`")


@dataclass(frozen=True)
class KeyRing:
    """The keys records are sealed and opened with. Its repr shows ids only, never a key."""

    current: str
    keys: Mapping[str, bytes] = field(repr=False)
    retired: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"KeyRing(current={self.current!r}, ids={sorted(self.keys)!r}, retired={sorted(self.retired)!r})"


def _refuse(source: str, what: str) -> ConfigError:
    return ConfigError(f"{SETTING}: {what} (source {source!r}); allowed: {_FORMAT}")


def parse_ring(text: str, source: str) -> KeyRing:
    """A ring from its JSON text; `ConfigError` (one line, no secret) when it is not a valid ring."""
    try:
        raw = json.loads(text)
    except (ValueError, TypeError):
        raise _refuse(source, "not valid JSON") from None
    if not isinstance(raw, Mapping):
        raise _refuse(source, "not a JSON object")
    unknown = sorted(set(raw) - {"current", "keys", "retired"})
    if unknown:
        raise _refuse(source, f"unknown field {unknown[0]!r}")
    keys_raw, current, retired_raw = raw.get("keys"), raw.get("current"), raw.get("retired", [])
    if not isinstance(keys_raw, Mapping) or not keys_raw:
        raise _refuse(source, "no keys")
    keys: dict[str, bytes] = {}
    for kid, value in keys_raw.items():
        if not KEY_ID_PATTERN.match(kid):
            raise _refuse(source, f"key id {kid[:64]!r} is not a valid id")
        keys[kid] = _key_bytes(kid, value, source)
    if not isinstance(retired_raw, list) or not all(isinstance(k, str) and KEY_ID_PATTERN.match(k)
                                                    for k in retired_raw):
        raise _refuse(source, "retired is not a list of key ids")
    retired = frozenset(retired_raw)
    if not isinstance(current, str) or current not in keys:
        raise _refuse(source, "current does not name one of the keys")
    if current in retired:
        raise _refuse(source, f"the current key {current!r} is also listed as retired")
    return KeyRing(current, {k: v for k, v in keys.items() if k not in retired}, retired)


def _key_bytes(kid: str, value: Any, source: str) -> bytes:
    if not isinstance(value, str):
        raise _refuse(source, f"key {kid!r} is not a base64 string")
    try:
        key = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(source, f"key {kid!r} is not valid base64") from None
    if len(key) != KEY_BYTES:
        raise _refuse(source, f"key {kid!r} is {len(key)} bytes, not {KEY_BYTES}")
    return key


def load_ring(source: str) -> KeyRing:
    """Read the ring from a file path or ``env:NAME``; `ConfigError` naming the setting when it cannot."""
    if source.startswith(ENV_PREFIX):
        name = source[len(ENV_PREFIX):]
        text = os.environ.get(name)
        if not name or text is None:
            raise ConfigError(f"{SETTING}: environment variable {name!r} is not set (source {source!r}); "
                              f"allowed: set it to the ring's JSON, or name a ring file instead")
        return parse_ring(text, source)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"{SETTING}: cannot read the ring file {source!r} ({exc.strerror or exc}); allowed: "
                          f"a readable JSON ring file, or env:NAME") from None
    except UnicodeDecodeError:
        raise _refuse(source, "not UTF-8 text") from None
    return parse_ring(text, source)


def write_new_ring(path: str, key_id: str = "k1") -> str:
    """Write a fresh ring of one random key to ``path`` (created owner-only; an existing file is refused) and
    return the path: a first set-up, a benchmark's or a test's ring."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump({"current": key_id, "keys": {key_id: base64.b64encode(os.urandom(KEY_BYTES)).decode()}}, f)
    return path
