"""Admission to the slower tiers: which records a put writes down to disk, GDS or Redis, and when.

Why: every miss stores every chunk, and on one-off traffic most of them are never asked again; writing
them to disk and Redis costs the writer's time (disk syncs, network) on the machine that serves, and
evicts what would have been used. The fastest tier (memory) takes every put; a slower tier whose
``admission`` is ``seen`` takes a record only once the record has been asked for ``min_seen`` times, or
at once when the put says its request reused at least ``reused_prompt_share`` of its prompt (the KV
connector's saves: a request that extends a reused prefix, whose new chunks the next turn will ask for).

Where accesses are counted: in the process that puts (the KV worker, the EC worker), by the store
itself: a put counts once (the miss that stored it), a hit counts once per `TieredStore.get_many` that
returns it (a load), whichever tier served it. Lookups (`contains_many`) do not count: a lookup followed
by its load would count one use twice, and the KV scheduler's lookups run in another process in vLLM's
multiprocess engines, where this process's counts are not. Counts live in the W-TinyLFU frequency sketch
(`FrequencySketch`), which remembers records that are no longer held, in bounded memory, and halves its
counts every ``window_records`` accesses, so a record is admitted when it comes back within that window,
whether it was still in memory (a hit) or evicted meanwhile (a second miss: its second put is admitted).

The promotion path: a record refused by some slower tier on its put lives in the memory tier only, and
is remembered here (its digest and the tiers that refused it, bounded). A memory hit that brings its
count to the threshold hands the memory copy to the background writer for those tiers (write-behind, as
any put). A record the memory tier evicts first is forgotten here; its count stays in the sketch.

Exempt (always admitted to every tier): puts with ``always_admit`` (precomputed and pinned records, the
KV event journal) and ``urgent`` puts (a prefill/decode hand-off, which another engine waits for).

A tier whose admission is ``evicted`` takes no put (exempt ones aside): it is written what the memory
tier evicts (`demote_to`; the store's `vllm_tiercache.shared.store.writes.demotion` does it), so it holds
what memory does not. Its puts are not counted refused: they reach it later, on eviction.

Counters, per slower tier: ``writes_admitted`` (records handed to it: admitted puts and write-downs),
``writes_refused`` (records a put kept in memory only).

Dead on arrival (`drop_orphans`, before any rule above, exempt puts excepted): a record whose meta names
a parent (`vllm_tiercache.shared.eviction.lineage`: a KV block's record names the block before it) that
is neither earlier in the same put nor held by any tier, and every record below it in that put, is
written to memory only, counted ``refused`` on each slower tier. A lookup stops at the first block it
misses, so such a record cannot be found while its parent is missing: writing it down would cost a
disk write and evict a record that can be found. The memory tier keeps it (its `prefix` policy evicts
it first) in case the parent is put again soon.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllm_tiercache.shared.eviction.lineage import parent_of
from vllm_tiercache.shared.eviction.sketch import FrequencySketch
from vllm_tiercache.shared.store.admission_config import AdmissionConfig
from vllm_tiercache.shared.store.api import Record, StoreKey, Tier

#: Records refused somewhere and still in memory that are remembered, per window record: past this the
#: oldest are forgotten (their next put, with a count past the threshold, is admitted anyway).
_REMEMBERED_PER_WINDOW = 4


class AdmissionGate:
    """The admission rule of each slower tier of one store (thread-safe); see the module docstring.

    ``rules[i]`` is the rule of ``slower[i]`` (None: always)."""

    def __init__(self, slower: Sequence[Tier], rules: Sequence[AdmissionConfig | None]) -> None:
        self.slower = list(slower)
        #: bit i set: slower[i] is written the memory tier's evictions instead of puts (admission ``evicted``)
        self._demote = sum(1 << i for i, rule in enumerate(rules) if rule is not None and rule.evicted)
        #: the tiers the memory tier's evictions are written down to (the store's demotion)
        self.demote_to = [tier for i, tier in enumerate(self.slower) if self._demote >> i & 1]
        counted = [rule if rule is not None and rule.policy == "seen" else None for rule in rules]
        self._min_seen = [0 if rule is None else rule.min_seen for rule in counted]
        #: slower[i] admits a put whose request reused at least this share of its prompt (None: never)
        self._reused_share = [None if rule is None else rule.reused_prompt_share for rule in counted]
        #: slower[i]'s sketch, as an index into ``_sketches`` (one sketch per window size); None: always
        self._sketch_of: list[int | None] = []
        sketches: dict[int, FrequencySketch] = {}
        for rule, threshold in zip(counted, self._min_seen, strict=True):
            if not threshold:
                self._sketch_of.append(None)
                continue
            assert rule is not None
            window = rule.window_records
            if window not in sketches:  # halve after `window` increments: the sketch's sample size
                sketches[window] = FrequencySketch(window, sample_factor=1)
            self._sketch_of.append(list(sketches).index(window))
        self._sketches = list(sketches.values())
        self._limit = _REMEMBERED_PER_WINDOW * max((rule.window_records for rule in counted if rule), default=0)
        #: digest -> bit i set: slower[i] refused the record, which the fastest tier still holds
        self._refused: dict[bytes, int] = {}
        self._lock = threading.Lock()
        #: False when every slower tier admits everything: puts skip the gate
        self.active = any(self._min_seen) or bool(self._demote)
        #: False when no tier counts uses (``seen``): reads skip the gate
        self._counting = any(self._min_seen)

    def _count(self, keys: Sequence[StoreKey]) -> list[list[int]]:
        """Count one access of each key; its frequency in each sketch (by sketch index), lock held."""
        out = []
        for sketch in self._sketches:
            out.append([sketch.add(key.digest) for key in keys])
        return out

    def _passes(self, freqs: list[list[int]], i: int, j: int) -> bool:
        """Whether slower[i] admits the j-th counted key."""
        sketch = self._sketch_of[i]
        return sketch is None or freqs[sketch][j] >= self._min_seen[i]

    def _admits_reuse(self, i: int, reused_share: float | None) -> bool:
        """Whether slower[i] admits a record whose request reused ``reused_share`` of its prompt."""
        threshold = self._reused_share[i]
        return threshold is not None and reused_share is not None and reused_share >= threshold

    def on_put(self, items: Sequence[Any], *, exempt: bool, reused_shares: Sequence[float | None] | None = None
               ) -> list[tuple[list[Tier], list[Any]]]:
        """The writes a put makes to the slower tiers: (tiers, items) groups; counts each tier's admitted
        and refused records. ``exempt``: every tier takes every item. ``reused_shares``: per item, the share
        of its prompt the putting request reused (None: no request)."""
        if not exempt and not self._counting:  # only ``evicted`` tiers differ: the others take every put
            through = [tier for i, tier in enumerate(self.slower) if not self._demote >> i & 1]
            for tier in through:
                tier.counters.add(writes_admitted=len(items))
            return [(through, list(items))] if through else []
        if exempt or not self.active:
            if self._counting:  # written everywhere now: nothing left to write down on its next use
                with self._lock:
                    for item in items:
                        self._refused.pop(item[0].digest, None)
            for tier in self.slower:
                tier.counters.add(writes_admitted=len(items))
            return [(self.slower, list(items))]
        groups: dict[int, list[Any]] = {}
        with self._lock:
            freqs = self._count([item[0] for item in items])
            for j, item in enumerate(items):
                share = reused_shares[j] if reused_shares is not None else None
                refused = 0
                for i in range(len(self.slower)):
                    if not self._passes(freqs, i, j) and not self._admits_reuse(i, share):
                        refused |= 1 << i
                if refused:
                    self._remember(item[0].digest, refused)
                else:
                    self._refused.pop(item[0].digest, None)
                groups.setdefault(refused, []).append(item)
        return self._groups(groups)

    def on_read(self, keys: Sequence[StoreKey], records: Sequence[Record | None], served_first: Sequence[int]
                ) -> list[tuple[list[Tier], list[Any]]]:
        """`on_hits` for a read's answer: ``records`` per key (None: a miss), ``served_first`` the indexes of
        the records the fastest tier served."""
        hit = [i for i, rec in enumerate(records) if rec is not None]
        first = set(served_first)
        fastest = {j: (keys[i], rec.tensor, rec.meta) for j, i in enumerate(hit)
                   if i in first and (rec := records[i]) is not None}
        return self.on_hits([keys[i] for i in hit], fastest)

    def on_hits(self, keys: Sequence[StoreKey], fastest: dict[int, Any]) -> list[tuple[list[Tier], list[Any]]]:
        """Count one access of each key a read returned; the write-downs that admits: (tiers, items) groups
        of the records the fastest tier served (``fastest``: key index -> its item (key, tensor, meta))
        that some tier refused and now admits."""
        if not self._counting or not keys:
            return []
        groups: dict[int, list[Any]] = {}
        with self._lock:
            freqs = self._count(keys)
            for j, item in fastest.items():
                refused = self._refused.get(keys[j].digest)
                if not refused:
                    continue
                admits = 0
                for i in range(len(self.slower)):
                    if refused >> i & 1 and self._passes(freqs, i, j):
                        admits |= 1 << i
                if not admits:
                    continue
                if refused & ~admits:
                    self._refused[keys[j].digest] = refused & ~admits
                else:
                    del self._refused[keys[j].digest]
                groups.setdefault(admits, []).append(item)
        out = []
        for admits, items in groups.items():
            tiers = [tier for i, tier in enumerate(self.slower) if admits >> i & 1]
            for tier in tiers:
                tier.counters.add(writes_admitted=len(items))
            out.append((tiers, items))
        return out

    def _groups(self, by_refused: dict[int, list[Any]]) -> list[tuple[list[Tier], list[Any]]]:
        """(tiers, items) per set of refusing tiers (bit i: slower[i] refused), counted per tier."""
        out = []
        for refused, items in by_refused.items():
            tiers = [tier for i, tier in enumerate(self.slower) if not (refused | self._demote) >> i & 1]
            for i, tier in enumerate(self.slower):
                if not self._demote >> i & 1:  # an ``evicted`` tier is written later, on eviction
                    tier.counters.add(**{"writes_refused" if refused >> i & 1 else "writes_admitted": len(items)})
            if tiers:
                out.append((tiers, items))
        return out

    def _remember(self, digest: bytes, refused: int) -> None:
        self._refused.pop(digest, None)
        self._refused[digest] = refused
        if len(self._refused) > self._limit:
            del self._refused[next(iter(self._refused))]

    def forget(self, digest: bytes) -> None:
        """The fastest tier dropped the record: nothing is left to write down (its count stays)."""
        if self._counting:
            with self._lock:
                self._refused.pop(digest, None)


def drop_orphans(items: Sequence[Any], reused_shares: Sequence[float | None] | None,
                 held: Callable[[list[StoreKey]], list[bool]], slower: Sequence[Tier]
                 ) -> tuple[list[Any], list[float | None] | None]:
    """The items of a put worth writing down, and their ``reused_shares``: without the records whose parent
    is neither an earlier item nor ``held`` (a batched lookup of the parents' digests), nor those below
    them in this put (module docstring); the ones left out are counted ``refused`` on every slower tier.

    One lookup per put, of the parents outside it (a connector's put is a chain: one parent, the block
    before the chunks it saves), so the cost per record is a set lookup.
    """
    seen: set[bytes] = set()
    outside: dict[bytes, None] = {}  # parents named before they are put (in order, once)
    for key, _, meta in items:
        parent = parent_of(meta)
        if parent is not None and parent not in seen and parent != key.digest:
            outside[parent] = None
        seen.add(key.digest)
    dead_parents: set[bytes] = set()
    if outside:
        asked = list(outside)
        dead_parents = {p for p, found in zip(asked, held([StoreKey("", p) for p in asked]), strict=True)
                        if not found}
    in_put: dict[bytes, bool] = {}  # digest -> dead (an orphan, or below one)
    kept: list[Any] = []
    shares: list[float | None] = []
    for j, item in enumerate(items):
        parent = parent_of(item[2])
        dead = parent is not None and parent != item[0].digest and (
            in_put[parent] if parent in in_put else parent in dead_parents)
        in_put[item[0].digest] = dead
        if not dead:
            kept.append(item)
            shares.append(reused_shares[j] if reused_shares is not None else None)
    if len(kept) < len(items):
        for tier in slower:
            tier.counters.add(refused=len(items) - len(kept))
    return kept, (shares if reused_shares is not None else None)
