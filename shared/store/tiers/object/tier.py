"""Object tier: records as whole objects in an S3 bucket (AWS S3, MinIO, Ceph RGW, SeaweedFS), shared by
every process and host that reaches it, bounded by ``capacity`` across all of them.

A record is one object (`names` has the layout) holding the record format every tier stores
(`vllm_tiercache.shared.store.records`: header with the key digest, version, checksums and tags, then the
payload), or with ``layout: chunk`` one member of its KV chunk's pack (`packs`: the layers of a chunk in
one object, itself a record), so a PUT of the whole object is its commit: a writer killed mid-PUT leaves
nothing, and concurrent writers of one record write equal bytes (of one pack, the members each put brought:
`packs` says what that promises). A torn, corrupt or foreign object is a miss, counted
(``corrupt``) and deleted; another build's format is a miss left in place (``other_format``). Nothing
unchecked reaches the model.

Reads and writes put many requests in flight at once (`calls`: a bounded pool of threads over one boto3
client, `client` says why that client): a batch of N objects costs about N / ``concurrency`` round trips.

No request fails because the store is slow or gone: each request has its own timeout, the first that
runs into it (or finds the endpoint, the bucket or the credentials gone) marks the tier down, and the
prober (`health`) brings it back. An endpoint unreachable when the tier is built is one warning; the tier
starts down and requests are served without it. The bound on ``capacity`` and the eviction order (`order`,
from every writer's usage `ledger`) are the `janitor`'s; the admin side and the control entries are `admin`'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import (
    ChecksAtPreflight,
    DropsRecords,
    HonorsPins,
    Item,
    KeepsControl,
    Record,
    RemoteTier,
    ReportsHealth,
    ReportsUnwritten,
    StoredRecord,
    StoreKey,
    Unwritten,
)
from vllm_tiercache.shared.store.control import parse_control
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.object.admin import ObjectAdmin
from vllm_tiercache.shared.store.tiers.object.calls import NOT_SENT, Failure, ObjectCalls, failure_reason
from vllm_tiercache.shared.store.tiers.object.client import MISSING, THROTTLED, describe_attempt
from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig
from vllm_tiercache.shared.store.tiers.object.existence import ExistenceCache, warm
from vllm_tiercache.shared.store.tiers.object.health import ObjectHealth
from vllm_tiercache.shared.store.tiers.object.names import ObjectNames, members_in, record_metadata
from vllm_tiercache.shared.store.tiers.object.packs import Body, Group, PackLayout
from vllm_tiercache.shared.store.tiers.object.preflight import check_bucket
from vllm_tiercache.shared.store.tiers.object.sweeps.janitor import Janitor
from vllm_tiercache.shared.threads import background_thread


class ObjectTier(RemoteTier, ReportsHealth, KeepsControl, HonorsPins, DropsRecords, ChecksAtPreflight,
                 ReportsUnwritten):
    """Whole-record objects in an S3 bucket, many requests in flight, down and back without a stall."""

    kind = "object"
    shared_across_processes = True
    # `RemoteTier`: a call may hang up to ``timeout_s``, so the store bounds the schedulers' lookups.

    def __init__(self, config: ObjectTierConfig, name: str = "object") -> None:
        self.config = config
        self.name = name
        self.address = config.address
        self.capacity = config.capacity
        self.counters = TierCounters()
        self._names = ObjectNames(config.prefix)
        self._layout = PackLayout(pack=config.layout == "chunk")
        self._pins: frozenset[str] = frozenset()
        # the prober calls ``self._probe`` as it is when it runs (tests wrap it to see which thread probes)
        self._health = ObjectHealth(self.address, config.retry_after_s, self.counters,
                                    attempt=lambda: describe_attempt(config, self._calls.client),
                                    probe=lambda: self._probe(), thread_name=f"tiercache-probe-{name}")
        self._calls = ObjectCalls(config, self._health, thread_name=f"tiercache-s3-{name}")
        self._janitor = Janitor(config, self._names, self._calls, self.counters, self._pinned_now,
                                thread_name=f"tiercache-janitor-{name}")
        self._admin = ObjectAdmin(self._names, self._calls, self.address, self._ledger_reads)
        self._existence = ExistenceCache()
        self._warming: threading.Thread | None = None
        self._warm_on = True
        # last: one HEAD of the bucket; an endpoint away now is a warning and a tier that starts down
        self._calls.one("start", lambda: self._calls.client.head_bucket(Bucket=config.bucket))

    @classmethod
    def preflight(cls, config: ObjectTierConfig, path: str) -> None:
        """`ChecksAtPreflight`: one HEAD of the bucket (`preflight.check_bucket`)."""
        check_bucket(config, path)

    # ------------------------------------------------------------------------------------ availability
    @property
    def down(self) -> bool:
        return self._health.down

    @property
    def up_share(self) -> float:
        return 0.0 if self._health.down else 1.0

    @property
    def shards_down(self) -> list[str]:
        return []

    @property
    def probes(self) -> int:
        """Probes sent so far (tests check that none ran on a caller's thread)."""
        return self._calls.probes

    def tried(self) -> str:
        """What a request does, in words (endpoint, addressing, CA, region, credential source; no secret)."""
        return describe_attempt(self.config, self._calls.client)

    def _probe(self) -> bool:
        return self._calls.probe()

    @property
    def janitor(self) -> Janitor:
        """The capacity sweeps and usage ledger (tests and `tiercache bench` sweep on demand)."""
        return self._janitor

    # ------------------------------------------------------------------------------------------ reads
    @property
    def existence(self) -> ExistenceCache:
        """Records seen lately, answered without a HEAD while no eviction ran (`existence`)."""
        return self._existence

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Objects (`packs`: a KV chunk's pack answers for its layers) in the existence cache (`existence`:
        valid while ``sys/usage``'s eviction generation stays, one GET) are there; the others get one HEAD
        each, many in flight (a down tier answers all misses at once). Only HEADs that found an object fill
        the cache: it can under-promise, never over-promise."""
        calls, cache = self._calls, self._existence
        if self._health.down:
            return [False] * len(keys)
        groups = self._layout.group(keys)
        hexes = [group.key.hex for group in groups]
        known = cache.known(hexes)
        # validated when it answers something, or holds no generation (then none of these HEADs could enter it)
        # and no listing is under way (the first lookup costs its HEADs only: the listing validates meanwhile)
        first = self._warming is None and self._warm_on  # the listing starts once this lookup is answered
        warming = first or (self._warming is not None and self._warming.is_alive())
        if any(known) or (cache.generation is None and not warming):
            valid = cache.validate(self._janitor.marks.generation(), self._janitor.marks.evicted_between)
            known = cache.known(hexes) if valid else [False] * len(groups)
        generation = cache.generation  # read before the HEADs below
        ask = [i for i, hit in enumerate(known) if not hit]
        res = calls.many("contains", lambda i: calls.exists(self._names.record_of(hexes[i])), ask)
        found_objects = list(known)
        for i, r in zip(ask, res, strict=True):
            found_objects[i] = not isinstance(r, Failure)
        cache.add((hexes[i] for i, r in zip(ask, res, strict=True) if not isinstance(r, Failure)), generation)
        if first:
            self._start_warming()
        found = [False] * len(keys)
        for group, there in zip(groups, found_objects, strict=True):
            # a pack this process wrote answers for the members it holds only (the others would be misses)
            held = self._layout.written(group.key) if there and group.packed else None
            for i in group.positions:
                found[i] = there and (held is None or keys[i].digest in held)
        return found

    def _start_warming(self) -> None:
        """One background listing of the records into the existence cache (`existence.warm`), on the first
        lookup: a new server of a precomputed corpus then answers its lookups from the cache."""
        def listing() -> Iterator[str]:
            for obj in self._calls.list_names(self._names.records):
                h = self._names.digest_of(obj["Key"])
                if h is not None:
                    yield h

        def run() -> None:
            try:
                warm(self._existence, self._janitor.marks.generation, listing)
            except Exception as exc:  # the endpoint went away meanwhile: lookups HEAD as before
                self._health.other_error("existence listing", exc)

        self._warming = background_thread(run, f"tiercache-warm-{self.name}", beside_forward=True)
        self._warming.start()

    def set_warming(self, on: bool) -> None:
        """Whether the first lookup lists the prefix into the existence cache (on by default; `tiercache bench
        lookups` turns it off to measure lookups by HEAD alone)."""
        self._warm_on = on

    def warmed(self, timeout: float | None = None) -> bool:
        """Wait for the existence cache's listing (started by the first lookup) to end; True when it has
        (tests, `tiercache bench lookups`)."""
        if self._warming is None:
            return False
        self._warming.join(timeout)
        return not self._warming.is_alive()

    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Each record's stored size from one HEAD per object; a pack's members each its share of the pack."""
        calls = self._calls
        groups = self._layout.group(keys)
        res = calls.many("sizes", lambda group: calls.head(self._names.record(group.key)), groups)
        out: list[int | None] = [None] * len(keys)
        for group, got in zip(groups, res, strict=True):
            if not isinstance(got, Failure):
                for i in group.positions:
                    out[i] = int(got["ContentLength"]) // members_in(got.get("Metadata") or {})
        return out

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        """Ranged GETs of ``range_size``, many in flight (`ObjectCalls.get_in_ranges`: one GET for an object no
        larger), one per object (`packs`: a KV chunk's layers asked together cost one GET of their pack);
        each object checked whole (`records.decode`: the tensor is built over the bytes received, no copy for
        a one-range object). Damaged objects are deleted, counted, and misses; a record missing from its
        pack is a miss counted ``partial``."""
        if not keys:
            return []
        calls = self._calls
        groups = self._layout.group(keys)
        generation = self._existence.generation  # read before the GETs below
        res = calls.get_in_ranges("get", [self._names.record(group.key) for group in groups],
                                  self.config.range_size)
        out: list[Record | None] = [None] * len(keys)
        corrupt: list[str] = []
        hits: list[str] = []
        for group, body in zip(groups, res, strict=True):
            if isinstance(body, Failure):
                if body.kind == MISSING:  # gone (a cached promise may have said otherwise): not cached again
                    self._existence.forget([group.key.hex])
                continue
            try:
                found = self._layout.decode(group, body, keys)
            except records.OtherFormatError:  # another build's record: a miss, left for that build
                self.counters.add(other_format=1)
                continue
            except records.RecordError as exc:
                corrupt.append(group.key.hex)
                self._health.other_error(f"decode ({exc})", exc)
                continue
            for i, rec in found.items():
                out[i] = rec
            if len(found) < len(group.positions):
                self.counters.add(partial=len(group.positions) - len(found))
            if found:
                hits.append(group.key.hex)
        if corrupt:
            self._existence.forget(corrupt)
            self.counters.add(corrupt=len(corrupt))
            calls.many("delete corrupt", lambda h: calls.delete(self._names.record_of(h)), corrupt)
        if hits:
            self._janitor.read(hits)
            self._existence.add(hits, generation)
        return out

    def drop_many(self, keys: Sequence[StoreKey]) -> None:
        """Delete these keys' objects (`DropsRecords`: records the store cannot open, or promoted into memory),
        many in flight; an absent one is no error, a failure is counted and left for the next reader. A pack
        goes only when these keys are all of its members (its ``tc-members``, one HEAD): the others may be
        records the memory tier let go of, whose only copy it is."""
        calls = self._calls
        groups = self._layout.group(keys)

        def drop(group: Group) -> None:
            name = self._names.record(group.key)
            if group.packed:
                members = members_in(calls.head(name).get("Metadata") or {})
                if len({keys[i].digest for i in group.positions}) < members:
                    return
            calls.delete(name)

        self._existence.forget(group.key.hex for group in groups)
        calls.many("drop", drop, groups)

    # ----------------------------------------------------------------------------------------- writes
    def put_many(self, items: Sequence[Item]) -> None:
        """`try_put_many`, each record it left unwritten a dropped write (counted)."""
        unwritten = self.try_put_many(items)
        if unwritten is not None:
            self.counters.add(dropped_writes=len(unwritten.positions))

    def try_put_many(self, items: Sequence[Item]) -> Unwritten | None:
        """One PUT of each whole object (`packs`: a KV chunk's layers of this put in one), many in flight; the
        records of what failed (down, hung, throttled, refused) come back for the caller to drop or put again.
        Objects are encoded first, so that the janitor admits each by its real size: as many of the leading
        objects as fit in this writer's grant go out together, then the next ones (a full grant waits for a
        sweep, `Janitor.admit`); the records of those it does not admit are dropped writes, counted here (a
        later try would find the grant as full)."""
        if not items:
            return None
        calls = self._calls
        janitor = self._janitor
        groups = self._layout.group([item[0] for item in items])
        kept, unread = self._members_kept([group for group in groups if self._layout.short_of(group, items)])
        failed = [i for group in groups if group.key.digest in unread for i in group.positions]
        first_failure: Failure | None = next(iter(unread.values()), None)
        encoded = [(group, self._layout.encode(group, items, kept.get(group.key.digest, ()))) for group in groups
                   if group.key.digest not in unread]
        generation = self._existence.generation  # read before the PUTs below
        pos = 0
        while pos < len(encoded):
            n = janitor.admit([len(body.data) for _, body in encoded[pos:]])
            if not n:  # no room in this writer's grant and no sweep came: the tier stays bounded
                left = [i for group, _ in encoded[pos:] for i in group.positions]
                if self.down:  # the janitor could not ask: the records are unwritten, not refused
                    failed.extend(left)
                    first_failure = first_failure or NOT_SENT
                else:
                    self.counters.add(dropped_writes=len(left))
                break
            batch = encoded[pos:pos + n]

            def put(item: tuple[Group, Body]) -> int:
                group, body = item
                calls.put_record(self._names.record(group.key), body.data,
                                 record_metadata(group.key, body.tags, body.members))
                return len(body.data)

            res = calls.many("put", put, batch)
            ok = [(group, nbytes, body.parent) for (group, body), nbytes in zip(batch, res, strict=True)
                  if not isinstance(nbytes, Failure)]
            written = sum(nbytes for _, nbytes, _ in ok)
            janitor.wrote(sum(len(body.data) for _, body in batch), written,
                          [(group.key.hex, parent) for group, _, parent in ok])
            self._existence.add((group.key.hex for group, _, _ in ok), generation)
            if ok:
                self.counters.add(puts=sum(len(group.positions) for group, _, _ in ok), bytes_written=written)
            for (group, _), got in zip(batch, res, strict=True):
                if isinstance(got, Failure):
                    failed.extend(group.positions)
                    first_failure = first_failure or got
            pos += n
        if not failed or first_failure is None:
            return None
        return Unwritten(tuple(sorted(failed)), failure_reason(first_failure), first_failure.kind == THROTTLED)

    def _members_kept(self, short: list[Group]
                      ) -> tuple[dict[bytes, list[tuple[StoreKey, Record]]], dict[bytes, Failure]]:
        """The members of the packs in ``short`` as stored now (one GET each): a put that brings only some
        of a pack's members keeps the others (`PackLayout.short_of`). A pack gone, damaged or another build's
        keeps none; a pack that could not be read now (down, hung, throttled) is not written either: its
        put's records come back unwritten (the second dict, by pack digest), never replacing it with fewer."""
        if not short:
            return {}, {}
        bodies = self._calls.get_in_ranges("get", [self._names.record(group.key) for group in short],
                                           self.config.range_size)
        kept: dict[bytes, list[tuple[StoreKey, Record]]] = {}
        unread: dict[bytes, Failure] = {}
        for group, body in zip(short, bodies, strict=True):
            if isinstance(body, Failure):
                if body.kind != MISSING:
                    unread[group.key.digest] = body
                continue
            try:
                kept[group.key.digest] = self._layout.members(group, body)
            except records.RecordError:  # damaged or another build's: written anew with this put's
                pass
        return kept, unread

    # ------------------------------------------------------------------------------ admin (stats/evict)
    def _ledger_reads(self) -> dict[str, float]:
        """Every writer's reads (for idle times), as the janitor merges them."""
        return self._janitor.merged_reads()

    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every record under the prefix (the `Tier` admin contract); ConnectionError when unreachable."""
        for _, rec in self._admin.scan():
            yield rec

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """Delete the records ``predicate`` accepts (the `Tier` admin contract): (records, bytes). The deletes
        are bracketed in ``sys/usage`` (`EvictionMarks.bracket`), as a sweep's are: every process's
        existence cache drops what it held."""
        if dry_run:
            return self._admin.delete_stored(predicate, dry_run=True)
        return self._janitor.marks.bracket(self._janitor.lock, lambda: self._admin.delete_stored(predicate))

    def read_control(self) -> dict[str, bytes]:
        return self._admin.read_control()

    def write_control(self, changes: Mapping[str, bytes | None]) -> None:
        self._admin.write_control(changes)

    def remove_control(self, name: str) -> bool:
        return self._admin.remove_control(name)

    def _pinned_now(self) -> frozenset[str]:
        """The tags pinned now, read from the control entries at the sweep (as the disk tier reads them in
        its eviction's transaction: every writer agrees, even one whose poller has not run yet); the last
        poll's when they cannot be read."""
        try:
            return parse_control(self._admin.read_control()).pinned_now() | self._pins
        except ConnectionError:
            return self._pins

    def set_pinned_tags(self, tags: frozenset[str]) -> None:
        """Records carrying one of ``tags`` are kept by the janitor's sweeps, up to ``pin_budget``."""
        self._pins = frozenset(tags)

    # ------------------------------------------------------------------------------------------- misc
    def usage(self) -> dict[str, Any]:
        """``entries`` and ``bytes_used`` as this process's janitor last listed them (None before any
        sweep: no request ever lists the bucket), else as the last sweep of any writer left them in the
        bucket; ``capacity`` from the config."""
        if self._janitor.last is None and not self._health.down:
            self._janitor.learn_usage()
        last = self._janitor.last
        return {"entries": last.entries if last else None, "bytes_used": last.bytes_used if last else None,
                "capacity": self.capacity, "down": self._health.down, "address": self.address}

    def close(self) -> None:
        self._janitor.close()
        self._calls.close()

