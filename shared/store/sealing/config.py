"""The store's ``encryption`` section: where the key ring comes from (never the keys themselves).

Why a separate module without torch or `cryptography`: reading a config must stay cheap and must not
import either (the config schema and `make docs` read it); the ring is read when a store is built, and by
the preflight check (`vllm_tiercache.shared.store.sealing.ring.load_ring`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import ConfigDict, Field, Strict

from vllm_tiercache.shared.store.tier_config import Allowed

#: A ring source naming an environment variable instead of a file: ``env:TIERCACHE_RING``.
ENV_PREFIX = "env:"


@dataclass(frozen=True)
class EncryptionConfig:
    """Seal every record a tier outside the process keeps (`vllm_tiercache.shared.store.sealing.sealer`)."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    ring: Annotated[str, Strict(), Field(min_length=1, description=(
        "Where the key ring is read from when the store starts: a path to a JSON file (owner-only "
        "permissions advised), or env:NAME for an environment variable holding the same JSON. The ring is "
        '{"current": "<id>", "keys": {"<id>": "<base64 of 32 bytes>", ...}, "retired": ["<id>", ...]}: new '
        "records are sealed under the current key, older ones open while their key is in keys, and records "
        "of a retired id are misses (`tiercache evict --key-id` reclaims them). The keys never belong in "
        "this config.")),
        Allowed("a path to a JSON ring file, or env:NAME naming an environment variable that holds it")]
