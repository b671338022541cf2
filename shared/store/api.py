"""The contract every part of vllm-tiercache codes against: what a store key is and what a store does.

Connectors never touch a tier directly. They build keys with `vllm_tiercache.shared.naming.keys`, turn them
into `StoreKey`s, and talk to one `TieredStore` per process (see `vllm_tiercache.shared.store.get_store`).
Keeping this file tiny and dependency-free lets the scheduler side, the worker side and the offline jobs
agree on one interface.

A tier is `Tier` plus the optional capabilities below it (`TIER_CAPABILITIES`), each declared by naming
its class among the tier class's bases: `class DiskTier(ReadsInto, Prefetches, TakesPayloadAllocator)`.
The store asks ``isinstance(tier, Capability)`` and nothing else; it never probes a tier for an attribute
nor branches on a tier's kind (`tests/store/test_tier_contract.py` enforces both), so what a tier does
is what its class line says. A tier that declares nothing is served by the plain `Tier` operations.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

#: Bytes of the blake2b digest that names a record in every tier (file names, Redis keys, headers).
KEY_DIGEST_SIZE = 16

#: blake2b personalization of key digests, one per record format (`records.VERSION`): format 1 uses none,
#: a later format must set its own (e.g. ``b"tiercache-f2"``) so that builds writing different formats
#: into one shared tier name their records apart and never overwrite or read each other's.
KEY_SPACE = b""


def key_text_bytes(text: str) -> bytes:
    """The bytes of a key text, as hashed into its digest and kept beside a record (index, Redis).

    Any str encodes, lone surrogates included ("surrogatepass"), so a name decoded with
    errors="surrogateescape" never makes building or storing its key raise; valid text is plain UTF-8.
    """
    return text.encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class StoreKey:
    """A record's identity: the canonical text of a `vllm_tiercache.shared.naming.keys` key and its digest.

    The text is for humans (stats, logs); tiers only ever use `digest`, so no key can become a path.
    Any str hashes (see `key_text_bytes`).
    """

    text: str
    digest: bytes = field(repr=False, compare=False, default=b"")
    #: The tenant salt (vLLM's ``cache_salt``) of the request the record serves, None without one: what a
    #: sealing store derives the record's subkey from (`vllm_tiercache.shared.store.sealing`). Not part of the
    #: key's identity (the salt already entered the text's hash) and never stored, logged or shown.
    tenant: str | None = field(repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if not self.digest:
            raw = key_text_bytes(self.text)
            digest = hashlib.blake2b(raw, digest_size=KEY_DIGEST_SIZE, person=KEY_SPACE).digest()
            object.__setattr__(self, "digest", digest)

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def for_tenant(self, tenant: str | None) -> StoreKey:
        """This key for the request of tenant salt ``tenant`` (itself when None, or already so)."""
        if tenant is None or tenant == self.tenant:
            return self
        return StoreKey(self.text, self.digest, tenant)

    @property
    def namespace(self) -> str:
        """First field of the canonical text (every `vllm_tiercache.shared.naming.keys` key starts with its
        namespace)."""
        return self.text.split("|", 1)[0]


#: What a put hands a store or a tier for one record: its key, its tensor and its meta (None: none).
Item = tuple[StoreKey, torch.Tensor, dict[str, Any] | None]


@dataclass
class Record:
    """What a store returns: one tensor (any shape and dtype) and a small JSON-able metadata dict."""

    tensor: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)
    #: True when the payload was read into the destination the caller gave `Store.get_many` (``into``):
    #: the bytes already sit where the caller wanted them, verified, and that memory stays the caller's.
    #: ``pieces`` are that destination; ``tensor`` is then a data-less ("meta") tensor of the record's
    #: dtype and shape (`vllm_tiercache.shared.store.records.joined_copy` gives the data as one tensor)
    in_place: bool = False
    pieces: tuple[memoryview, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass(frozen=True)
class StoredRecord:
    """One stored record as the admin commands (`tiercache stats`, `tiercache evict`) see it.

    Why not a `StoreKey`: tiers name records by digest only and keep the key text beside them just for
    these commands. ``text`` is ``""`` for a record stored without it (a disk index rebuilt from record
    headers, Redis records written before texts were kept); parse it with
    `vllm_tiercache.shared.naming.keys.parse_key_text`.
    """

    text: str
    #: Bytes as stored (header + payload); None when the tier cannot tell (an unreadable Redis head).
    nbytes: int | None
    #: Seconds since the record was last read or written; None when the tier cannot tell.
    idle_s: float | None
    #: The record's tags (`vllm_tiercache.shared.store.tags`); () when it has none or the tier keeps none.
    tags: tuple[str, ...] = ()


class TierAdminUnsupported(Exception):
    """The tier cannot list or delete its records from this process; the message says why.

    Raised by `Tier.iter_stored` and `Tier.delete_stored` of a tier whose records live inside each
    serving process (memory): an admin command in another process would see only its own, empty copy.
    Callers report a note for that tier, not a failure.
    """


class Store(Protocol):
    """What both connectors and the jobs use. `TieredStore` implements it.

    ``shared_only`` lookups consult only tiers other processes also see (a scheduler asking about what a
    worker process could load); ``bounded`` ones (by default the ``shared_only`` ones) wait at most the
    store's ``lookup_budget_ms`` for a remote tier, whose late answer is a miss; ``owned`` puts hand over
    tensors the caller will never mutate (no copy); ``urgent`` puts (a prefill/decode hand-off's records)
    reach the slower tiers ahead of the writes already queued; ``always_admit`` puts (precomputed and
    pinned records) and ``urgent`` ones bypass the slower tiers' admission (`vllm_tiercache.shared.store.admission`),
    and a put's ``reused_shares`` (per record, the share of its prompt the putting request reused) may admit at once.
    """

    def contains_many(self, keys: Sequence[StoreKey], shared_only: bool = False, *,
                      bounded: bool | None = None, reach: Reach = "all") -> list[bool]: ...
    def get(self, key: StoreKey) -> Record | None: ...
    def get_many(self, keys: Sequence[StoreKey], *, into: Sequence[Sequence[memoryview] | None] | None = None,
                 reach: Reach = "all") -> list[Record | None]:
        """Records for ``keys`` (None: a miss); ``reach`` (`in_reach`): which tiers are asked. ``into``: per
        key, where the caller wants the payload (or None): writable byte views of CPU memory that, one
        after the other, are the destination (the KV connector gives a record's blocks in the paged cache,
        in the record's order). A tier that reads from a file lands a payload of exactly that many bytes
        there, verified, and returns a record with ``in_place`` set, saving a buffer and a copy; a record
        of another size comes back as usual. A miss may have written into the destination: the caller
        must treat it as garbage then (the KV connector reports those blocks as failed loads)."""
        ...

    def put(self, key: StoreKey, tensor: torch.Tensor, meta: dict[str, Any] | None = None, *,
            owned: bool = False, always_admit: bool = False) -> None: ...
    def put_many(self, items: Sequence[Item], *,
                 owned: bool = False, urgent: bool = False, always_admit: bool = False,
                 reused_shares: Sequence[float | None] | None = None) -> None: ...
    def prefetch(self, keys: Sequence[StoreKey]) -> None:
        """A hint that ``keys`` will be read soon, for the tiers declaring `Prefetches`."""
        ...

    def flush(self, timeout: float | None = None) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
    @property
    def write_patience_s(self) -> float:
        """> 0 for a batch writer's store (`vllm_tiercache.shared.store.writes.patience`): its callers may wait for
        room instead of dropping a save, and wait that much longer for a flush. 0 when serving."""
        ...

    @property
    def tiers(self) -> list[Tier]: ...
    @property
    def far_tiers(self) -> list[Tier]:
        """The tiers declaring `RemoteTier` (their calls cross the network)."""
        ...
    @property
    def memory_tier(self) -> Tier | None:
        """The first tier declaring `InProcessTier` (what a worker's residency reports describe), if any."""
        ...

    def add_eviction_listener(self, listener: Callable[[str, bytes], None]) -> None:
        """``listener(tier_kind, digest)`` whenever a tier declaring `ReportsEvictions` drops a record."""
        ...

    @property
    def reads_into(self) -> bool:
        """True when some tier declares `ReadsInto`: ``get_many(..., into=...)`` may then save a copy."""
        ...

    def set_payload_allocator(self, allocator: PayloadAllocator | None) -> None:
        """Hand ``allocator`` to every tier declaring `TakesPayloadAllocator` (None: their own buffers again)."""
        ...


class TierCounting(Protocol):
    """What a tier's ``counters`` are (every built-in tier's: `vllm_tiercache.shared.store.counters.TierCounters`).

    The store reports their growth each engine step (`Store.take_counter_deltas`), and most steps count
    nothing: ``version`` moves with every `add`, so an unchanged version tells the store so without a
    snapshot (which takes the counters' lock and builds a dict per tier).
    """

    version: int

    def add(self, **deltas: float) -> None: ...
    def snapshot(self) -> dict[str, Any]: ...


class Tier(Protocol):
    """One level of a `TieredStore` (memory, disk, gds, redis). Connectors never use tiers directly.

    What every tier has; the optional capabilities follow (`TIER_CAPABILITIES`). ``kind`` is the name it
    is registered under (`vllm_tiercache.shared.store.registry`), for logs, stats and tier names only:
    nothing outside the registry decides anything by it.

    Tiers must be thread-safe. The serving operations never raise into the caller for a data or backend
    problem: corrupt or foreign data is a miss, an unreachable backend is a miss or a skipped write
    (counted). The admin operations (`iter_stored`, `delete_stored`) do raise, so an operator is told.
    """

    name: str
    kind: str
    #: True when another process (a scheduler beside its worker, a precompute job) sees what this tier holds.
    shared_across_processes: bool
    counters: TierCounting

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]: ...
    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]: ...
    def put_many(self, items: Sequence[Item]) -> None: ...
    def usage(self) -> dict[str, Any]:
        """``{"entries": int | None, "bytes_used": int | None, ...}``; ``"capacity"`` (bytes) when bounded.

        None: unknown (the backend is down). Tiers add their own fields (``path``, ``address``, ``down``).
        """
        ...

    def close(self) -> None: ...

    # Admin operations: the offline commands (`tiercache stats`, `tiercache evict`, precompute jobs) use
    # only these, so no command needs to know which kind of tier it talks to.
    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Bytes each key's record takes in this tier, without reading payloads; None: not stored here."""
        ...

    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every record this tier holds. Raises `TierAdminUnsupported` when this process cannot see them,
        `ConnectionError` when the backend is unreachable (an admin command must not report it empty)."""
        ...

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """Delete every record ``predicate`` accepts; returns (records, bytes), or what would be, with
        ``dry_run``. Safe beside serving processes (a later read is a miss). Raises as `iter_stored`."""
        ...


# ------------------------------------------------------------------------------------------------------------
# Optional capabilities. A tier class declares one by naming it among its bases; `TieredStore` uses a capability
# only through ``isinstance(tier, Capability)``. Why classes, not attributes the store looks for: a tier author
# then reads here everything the store may ask of a tier, a capability left unimplemented fails when the tier
# is built (abstract methods), and a method written without its declaration is caught by
# `tests/store/test_tier_contract.py` instead of being silently never called.

#: Gives a uint8 host tensor of n bytes for a payload to be read into (`TakesPayloadAllocator`).
PayloadAllocator = Callable[[int], torch.Tensor]


class RemoteTier:
    """Its calls cross the network and may hang up to the tier's own timeout (Redis). A declaration with
    no members: what it changes is how the store calls the tier.

    `TieredStore` runs the schedulers' lookups (``contains_many(..., bounded=True)``) of such a tier on a
    thread of its own (`vllm_tiercache.shared.store.bounded_lookup.BoundedLookup`) and waits at most
    ``lookup_budget_ms``.
    """


#: Which tiers a read asks: all of them, only the near ones (in-process memory, local files), or only the far ones
#: (`RemoteTier`). A forward pass reads ``near`` where a far record was fetched ahead (`vllm_tiercache.kvcache.lookup`).
Reach = Literal["all", "near", "far"]


def in_reach(tier: Tier, reach: Reach) -> bool:
    """Whether a read with ``reach`` asks ``tier``."""
    return reach == "all" or (reach == "far") == isinstance(tier, RemoteTier)


class ReportsHealth(ABC):
    """Knows whether its backend answers (Redis): for the ``tier_up`` gauge, and so that a bounded lookup
    of a tier that is down answers at once inline instead of waiting on its lookup thread."""

    @property
    @abstractmethod
    def down(self) -> bool:
        """The whole tier is down (its calls are misses and skipped writes until it is back)."""

    @property
    @abstractmethod
    def up_share(self) -> float:
        """The share of the tier that answers, 0.0 to 1.0 (a cluster with some shards down lies between);
        read from memory, never from the network: the gauges read it on a connector's step."""

    @property
    @abstractmethod
    def shards_down(self) -> list[str]:
        """The parts of the tier marked down now (cluster shards by "host:port"); empty when none are."""


class ReadsInto(ABC):
    """Reads a payload straight into memory the caller gives (disk: the KV cache's blocks, no buffer)."""

    @abstractmethod
    def get_many_into(self, keys: Sequence[StoreKey],
                      into: Sequence[Sequence[memoryview] | None]) -> list[Record | None]:
        """`Tier.get_many` landing each payload in ``into``: the contract of `Store.get_many` with ``into``."""


class Prefetches(ABC):
    """Can start reading records before they are asked for (disk: advises the kernel of their files)."""

    @abstractmethod
    def prefetch_many(self, keys: Sequence[StoreKey]) -> None:
        """A hint that ``keys`` will be read soon; never raises for a record it lacks."""


class ReportsEvictions(ABC):
    """Tells listeners which records it dropped to make room (memory: residency reports)."""

    @abstractmethod
    def add_eviction_listener(self, listener: Callable[[bytes], None]) -> None:
        """Call ``listener(digest)`` after a record leaves this tier."""


class InProcessTier(ReportsEvictions):
    """Holds its records as objects inside this process (memory): a hit is free, and no other process sees
    them, so ``shared_across_processes`` is False and the scheduler learns what it holds only from the
    worker's residency reports (`vllm_tiercache.shared.residency`), hence evictions must be reported.

    The store's first such tier is its `Store.memory_tier`; when it is the fastest tier, `TieredStore.prefetch`
    leaves out the keys it holds."""


class HandsOverEvictions(ABC):
    """Can hand the records it lets go of for room to a sink, whole (key, tensor, meta), and list what it
    holds: what an exclusive slower tier (admission ``evicted``) is written (`vllm_tiercache.shared.store.
    writes.demotion`). Memory: its evictions and the records it refuses on arrival, never an invalidation."""

    @abstractmethod
    def set_eviction_sink(self, sink: Callable[[list[tuple[StoreKey, torch.Tensor, dict[str, Any]]]], None] | None
                          ) -> None:
        """Call ``sink(items)`` with the records each put let go of for room, before the eviction listeners
        hear of them (None: no sink)."""

    @abstractmethod
    def held_items(self) -> list[tuple[StoreKey, torch.Tensor, dict[str, Any]]]:
        """Every record held now, least recently written first (a clean close writes them down)."""


class FileTier:
    """Keeps its records in files (disk, GDS): a KV hit served from such tiers alone is what vLLM counts as a
    disk hit (`CacheHitSource.DISK`, `vllm_tiercache.kvcache.scheduler`). A declaration with no members."""


class TakesPayloadAllocator:
    """Reads whole records into memory it is given when one is given (disk: a CUDA worker's pinned memory,
    so a hit reaches the GPU in one copy). Set through `Store.set_payload_allocator`, never by a connector."""

    #: Where whole-record reads put payloads; None: a buffer of the tier's own per record.
    payload_allocator: PayloadAllocator | None = None

    def set_payload_allocator(self, allocator: PayloadAllocator | None) -> None:
        """Read later payloads into what ``allocator(nbytes)`` returns (None: the tier's own buffers)."""
        self.payload_allocator = allocator


class KeepsControl(ABC):
    """Keeps the store's small shared control entries (invalidations by tag, pins:
    `vllm_tiercache.shared.store.control`) where every process sharing the tier reads them (disk: the
    index's ``control`` database; Redis: one hash). Admin commands write them; each store polls them."""

    @abstractmethod
    def read_control(self) -> dict[str, bytes]:
        """Every control entry (name -> value); raises when the backend is unreachable."""

    @abstractmethod
    def write_control(self, changes: Mapping[str, bytes | None]) -> None:
        """Set each entry (None: remove it), all at once; raises when the backend is unreachable."""

    @abstractmethod
    def remove_control(self, name: str) -> bool:
        """Remove one entry; True only for the one caller whose call removed it (claims a clean-up)."""


class HonorsPins(ABC):
    """Keeps records of pinned tags (memory: eviction skips them; Redis: written without a TTL). The
    store's control poller tells it the tags pinned now."""

    @abstractmethod
    def set_pinned_tags(self, tags: frozenset[str]) -> None:
        """The tags pinned now (replacing the last call's)."""


class DropsTagged(ABC):
    """Drops its records by tag when told (memory: the invalidations `tiercache evict --tag` writes into the
    shared control entries, which this process's store polls)."""

    @abstractmethod
    def drop_tagged(self, invalidations: dict[str, float]) -> int:
        """Drop records carrying a tag of ``invalidations`` (tag -> unix time) written before that time."""


class ExpiresRecords(ABC):
    """Its records carry a time to live (Redis with ``ttl_s``): a pin must take it away, an unpin give it
    back. Admin operations, raising as `Tier.iter_stored` does."""

    @abstractmethod
    def hold_tagged(self, tags: Collection[str], hold: bool) -> int:
        """Remove (``hold``) or give back the TTL of every record carrying one of ``tags``; returns how many."""


class DropsRecords(ABC):
    """Deletes records the store found unusable above the tier (a sealed record that can never open under
    this ring: `vllm_tiercache.shared.store.sealing`), as the tier deletes the corrupt records it finds."""

    @abstractmethod
    def drop_many(self, keys: Sequence[StoreKey]) -> None:
        """Delete these keys' records (absent ones are no error); never raises for a backend problem."""


class ChecksAtPreflight(ABC):
    """Can tell before an engine starts whether its backend takes these settings (object: the bucket exists,
    the credentials are accepted), so that a wrong setting is one line at start naming it
    (`vllm_tiercache.preflight`), not a tier that stays down; a backend that does not answer at all is a
    warning there (the tier starts down and requests are served without it)."""

    @classmethod
    @abstractmethod
    def preflight(cls, config: Any, path: str) -> None:
        """Raise `ConfigError` naming ``path`` (``tiers[i]``) and the setting when the backend refuses ``config``;
        log a warning and return when it cannot be reached."""


@dataclass(frozen=True)
class Unwritten:
    """What one try of a put left unwritten that a later try may write: the items' positions in the put, and
    why, in words fit for a log line (``"down: ReadTimeoutError"``, ``"throttled: SlowDown"``; never a URL or a
    secret). ``throttled``: the store asked to be called less often (S3's 503 SlowDown, Redis's OOM or
    LOADING), an answer to back off from, not a failure. Records a tier will never take (over its capacity)
    are not in it: trying again would not help."""

    positions: tuple[int, ...]
    reason: str
    throttled: bool = False


class ReportsUnwritten(ABC):
    """Tells which records a put did not write and why, so that a patient writer (a batch job's store,
    ``write_patience_s``: `vllm_tiercache.shared.store.writes.patience`) can put them again after a backoff instead
    of dropping them. Its ``put_many`` is ``try_put_many`` with the unwritten ones counted as dropped."""

    @abstractmethod
    def try_put_many(self, items: Sequence[Item]) -> Unwritten | None:
        """One try at writing ``items``; None when every one was written or will never be. Never raises for a
        backend problem, and counts nothing as dropped: the caller decides whether the rest is dropped."""


#: Every optional capability a tier class may declare, for the contract test and the docs.
TIER_CAPABILITIES: tuple[type, ...] = (
    RemoteTier, ReportsHealth, ReadsInto, Prefetches, ReportsEvictions, InProcessTier, FileTier, TakesPayloadAllocator,
    KeepsControl, HonorsPins, DropsTagged, ExpiresRecords, DropsRecords, ChecksAtPreflight, ReportsUnwritten)
