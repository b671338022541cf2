"""The object tier's existence cache: records this process saw in the bucket, answered without a HEAD while
no eviction can have removed them, so that a scheduler's lookup stays within ``lookup_budget_ms``.

Why a cache and not only HEADs in parallel: a lookup asks for every layer and rank of every chunk of a prompt
(32 chunks x 32 layers is 1,024 keys for an 8K prompt of an 8B model), and each HEAD costs botocore about a
millisecond of CPU and the store a round trip. Measured against a local SeaweedFS on 2 cores with 16 in
flight (`tiercache bench lookups`): 32 keys took 36-72 ms, 256 keys 0.23-1.2 s and 1,024 keys 0.8-1.6 s, so
past a few dozen keys the store's bounded lookup answered every key a miss within the default 100 ms
budget; from the cache, 1,024 keys took 2.6-7 ms (docs/operations.md, lookups within lookup_budget_ms).

Why it can only under-promise: records leave the bucket through evictions (the janitor's sweeps, `tiercache
evict`), and every eviction is bracketed in ``sys/usage``: before deleting, the evictor writes it with an
``evicting`` mark; after, with a new ``generation``. A lookup that finds cached keys first reads
``sys/usage`` (one GET, `EvictionMarks.generation`): while it is marked ``evicting`` (or unreadable) no
cached key is answered (they are HEADed as before); at a new generation, the cache drops the digests that
``sys/evicted`` lists for the one eviction from its generation to the new one (written before the new
generation), or everything when that is not the one eviction (several came between, or `tiercache evict`,
which does not list them). A key enters the cache only under the generation read *before* the request
that saw it (a HEAD, a GET or a PUT that succeeded): if the generation is still that one at a later lookup,
no eviction began in between, and if one eviction came between, it deleted only what it listed; either way
the record is there as surely as a fresh HEAD would say. What is not bracketed: records deleted
as damaged (a fresh HEAD would answer "there" for them too, and their load fails the same way) and deletes by
other tools or a bucket lifecycle rule (the cache then promises what a load misses: that load counts a
load error, `vllm:tiercache_kv_load_errors_total`, vLLM recomputes the blocks, and the key leaves the cache).
Misses are never cached: a record another instance writes later must be found. The cache holds object
digests: with ``layout: chunk`` a KV chunk's pack (`packs`) answers for its layers, and a pack another
process replaced with fewer layers is promised whole (its missing layers fail the chunk's prefetch,
counted ``partial``); the tier answers only for the members this process wrote into a pack it wrote lately.

A process that never saw a corpus (a new server of a precomputed corpus) would HEAD every key of its first
lookups, past the budget; so the first lookup also starts one background listing of the prefix (`warm`:
1,000 records per request, up to `MAX_ENTRIES`), whose records enter the cache under the generation read
before it, as a HEAD's do. An eviction during the listing (the generation moved) ends it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

#: Keys the cache holds at most (the least recently confirmed go first): about 100 bytes each.
MAX_ENTRIES = 1 << 18


class ExistenceCache:
    """Digests (hex) of records seen in the bucket under one eviction generation (module docstring)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: the eviction generation the entries were confirmed under; None: unknown (nothing is cached)
        self._generation: str | None = None

    @property
    def generation(self) -> str | None:
        """The generation last validated (None: unknown, or an eviction in progress)."""
        return self._generation

    def validate(self, generation: str | None,
                 evicted: Callable[[], tuple[str, str, list[str] | None] | None] | None = None) -> bool:
        """Take the generation just read from ``sys/usage``: True when the entries hold now. None (an eviction
        in progress, or unreadable): False, nothing answered now, entries kept (the next generation says
        what went). A new generation: when ``evicted()`` (``sys/evicted``) names the one eviction from this
        cache's generation to it, its digests are dropped and the rest holds; else everything is dropped."""
        if generation is None:
            return False
        with self._lock:
            current = self._generation
            if generation == current:
                return True
        change = evicted() if evicted is not None and current is not None else None
        with self._lock:
            if self._generation != current:  # another thread validated meanwhile: start over, empty
                self._known.clear()
                self._generation = generation
                return False
            self._generation = generation
            if change is not None and change[0] == current and change[1] == generation and change[2] is not None:
                for h in change[2]:
                    self._known.pop(h, None)
                return True
            self._known.clear()
            return False

    def known(self, hex_digests: Sequence[str]) -> list[bool]:
        """Which digests are cached (to be trusted only after `validate` returned True)."""
        with self._lock:
            return [h in self._known for h in hex_digests]

    def add(self, hex_digests: Iterable[str], generation: str | None) -> None:
        """Records seen by requests sent after ``generation`` was read: cached, unless the generation moved."""
        with self._lock:
            if generation is None or generation != self._generation:
                return
            for h in hex_digests:
                self._known[h] = None
                self._known.move_to_end(h)
            while len(self._known) > self.max_entries:
                self._known.popitem(last=False)

    def forget(self, hex_digests: Iterable[str]) -> None:
        """Records found missing or damaged: never answered from the cache again."""
        with self._lock:
            for h in hex_digests:
                self._known.pop(h, None)

    def __len__(self) -> int:
        return len(self._known)


def warm(cache: ExistenceCache, generation: Callable[[], str | None], listing: Callable[[], Iterator[str]],
         page: int = 1000) -> int:
    """Fill ``cache`` from one listing of the records (``listing``: their digests, as S3 lists them), under
    the generation read before it (``generation``: `EvictionMarks.generation`); stops when the cache is
    full or the generation moved (`add` then keeps nothing more). Returns how many digests it added."""
    gen = generation()
    cache.validate(gen)
    if gen is None:
        return 0
    added, batch = 0, []
    for h in listing():
        batch.append(h)
        if len(batch) >= page:
            cache.add(batch, gen)
            added += len(batch)
            batch = []
            if cache.generation != gen or added >= cache.max_entries:
                return added
    cache.add(batch, gen)
    return added + len(batch)
