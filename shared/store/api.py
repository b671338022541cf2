"""The contract every part of vllm-tiercache codes against: what a store key is and what a store does.

Connectors never touch a tier directly. They build keys with `vllm_tiercache.shared.keys`, turn them into `StoreKey`s,
and talk to one `TieredStore` per process (see `vllm_tiercache.shared.store.get_store`). Keeping this file tiny and
dependency-free lets the scheduler side, the worker side and the offline jobs agree on one interface.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

#: Bytes of the blake2b digest that names a record in every tier (file names, Redis keys, headers).
KEY_DIGEST_SIZE = 16


def key_text_bytes(text: str) -> bytes:
    """The bytes of a key text, as hashed into its digest and kept beside a record (index, Redis).

    Any str encodes, lone surrogates included ("surrogatepass"), so a name decoded with
    errors="surrogateescape" never makes building or storing its key raise; valid text is plain UTF-8.
    """
    return text.encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class StoreKey:
    """A record's identity: the canonical text of a `vllm_tiercache.shared.keys` key and its digest.

    The text is for humans (stats, logs); tiers only ever use `digest`, so no key can become a path.
    Any str hashes (see `key_text_bytes`).
    """

    text: str
    digest: bytes = field(repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if not self.digest:
            raw = key_text_bytes(self.text)
            object.__setattr__(self, "digest", hashlib.blake2b(raw, digest_size=KEY_DIGEST_SIZE).digest())

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def namespace(self) -> str:
        """First field of the canonical text (every `vllm_tiercache.shared.keys` key starts with its namespace)."""
        return self.text.split("|", 1)[0]


@dataclass
class Record:
    """What a store returns: one tensor (any shape and dtype) and a small JSON-able metadata dict."""

    tensor: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class Store(Protocol):
    """What both connectors and the jobs use. `TieredStore` implements it.

    ``shared_only`` lookups consult only tiers other processes also see (a scheduler asking about what a
    worker process could load); ``owned`` puts hand over tensors the caller will never mutate (no copy).
    """

    def contains_many(self, keys: Sequence[StoreKey], shared_only: bool = False) -> list[bool]: ...
    def get(self, key: StoreKey) -> Record | None: ...
    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]: ...
    def put(self, key: StoreKey, tensor: torch.Tensor, meta: dict[str, Any] | None = None, *,
            owned: bool = False) -> None: ...
    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]], *,
                 owned: bool = False) -> None: ...
    def flush(self, timeout: float | None = None) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
    @property
    def tiers(self) -> list[Tier]: ...
    @property
    def memory_tier(self) -> Tier | None: ...
    def add_eviction_listener(self, listener: Callable[[str, bytes], None]) -> None: ...


class Tier(Protocol):
    """One level of a `TieredStore` (memory, disk, gds, redis). Connectors never use tiers directly.

    Tiers must be thread-safe and must never raise into the caller for a data or backend problem:
    corrupt or foreign data is a miss, an unreachable backend is a miss or a skipped write (counted).
    """

    name: str
    kind: str
    #: True when another process (a scheduler beside its worker, a precompute job) sees what this tier holds.
    shared_across_processes: bool
    counters: Any  # vllm_tiercache.shared.store.counters.TierCounters

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]: ...
    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]: ...
    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None: ...
    def usage(self) -> dict[str, Any]: ...  # {"entries": int | None, "bytes_used": int | None, ...}
    def close(self) -> None: ...
