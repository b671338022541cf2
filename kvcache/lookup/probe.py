"""Where a request's chunks are, asked off the scheduling thread: the probe and the threads that run it.

Why a probe per chunk and not every record: a lookup of an 8K prompt of a 32-layer model names 1,024
records, and a miss (most first sights of a prompt) paid for all of them on the far tier. Here a far
tier is asked for one record per chunk (`RequestNames.probe_key`), in one batched call, and the chunks
count in order up to the first missing one. Whether every other record is there too is what the fetch
into host memory finds out (`vllm_tiercache.kvcache.load.prefetcher`): a chunk with a record missing
never becomes resident, so it is never claimed. The near shared tiers (local files) answer inline and
cheaply: there every record of a chunk is asked, since their hits are read in the forward pass.

A prompt that extends a stored one (a question after a precomputed document) finds the document's
partial last chunk by probing the shorter endings inside the first chunk that is missing, as the
synchronous lookup does (`PromptLookup._shorter_chunk`). Those of the first chunk are asked with the chunks
when that chunk is asked of the far tiers at all: a new prompt (a miss) then costs one round trip.

The threads: a few daemon threads take probes in arrival order. A tier that hangs holds a thread until
its own timeout; the request's deadline (`vllm_tiercache.kvcache.lookup.far`) does not wait for it, and a
hung call never delays the process's exit.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_tiercache.kvcache.naming import RequestNames
from vllm_tiercache.shared.store.api import Store
from vllm_tiercache.shared.threads import WorkerThreads

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Probes in flight at once: a tier that hangs holds one thread each; the others keep answering.
PROBE_THREADS = 4


class Where(enum.IntEnum):
    """Where a chunk was found (the lowest value that holds it)."""

    RESIDENT = 0  # the workers' memory tier, by their residency reports
    NEAR = 1  # a shared tier on this machine (disk): every record there, read in the forward pass
    FAR = 2  # a far tier (its probe record): fetched into host memory before the request runs
    MISSING = 3


@dataclass
class Probe:
    """One request's probe: its chunks in, where each is out (filled by a probe thread)."""

    request: Request
    names: RequestNames
    #: (end block, name) of every chunk of the prompt's full blocks, and whether the workers' memory holds it
    chunks: list[tuple[int, bytes]]
    resident: list[bool]
    #: per chunk, where it was found (``found``: every chunk asked; ``where``: up to the first missing one, then
    #: MISSING); and a shorter stored chunk inside the first missing one, as (end block, name, where)
    found: list[Where] = field(default_factory=list)
    where: list[Where] = field(default_factory=list)
    shorter: tuple[int, bytes, Where] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    #: the shorter endings inside the first chunk and the far tiers' answers for them, asked with the chunks
    _first_shorter: tuple[list[tuple[int, bytes]], list[bool]] | None = field(default=None, repr=False)

    def run(self, store: Store) -> None:
        """Ask the tiers (on a probe thread): the near ones for every record of the chunks not resident,
        the far ones for the probe record of the rest, each in one batched call."""
        where = [Where.RESIDENT if r else Where.MISSING for r in self.resident]
        todo = [i for i, r in enumerate(self.resident) if not r]
        if todo:
            names = self.names
            keys = [names.record_keys(self.chunks[i][1]) for i in todo]
            near = store.contains_many([k for ks in keys for k in ks], shared_only=True, bounded=False, reach="near")
            offset, far = 0, []
            for i, ks in zip(todo, keys, strict=True):
                if all(near[offset : offset + len(ks)]):
                    where[i] = Where.NEAR
                else:
                    far.append(i)
                offset += len(ks)
            # a first chunk asked of the far tiers may be missing (most first sights of a prompt are misses):
            # its shorter endings ride along in the same call, so such a miss costs one round trip, not two
            first_shorter = self._shorter_named(0) if far and far[0] == 0 else []
            if far:
                keys = [names.probe_key(self.chunks[i][1]) for i in far]
                keys += [names.probe_key(h) for _, h in first_shorter]
                found = store.contains_many(keys, shared_only=True, bounded=False, reach="far")
                for i, hit in zip(far, found[: len(far)], strict=True):
                    if hit:
                        where[i] = Where.FAR
                if first_shorter:
                    self._first_shorter = first_shorter, found[len(far):]
        self.found = where
        self.where = up_to_first_missing(where)
        cut = len(self.where) - self.where.count(Where.MISSING)
        if cut < len(self.chunks):
            self.shorter = self._shorter(store, cut)

    def _shorter_named(self, index: int) -> list[tuple[int, bytes]]:
        """(end block, name) of each shorter ending inside chunk ``index``, longest first."""
        end = self.chunks[index][0]
        start = self.names.naming.geometry.chunk_start(end)
        return [(e, self.names.name(e)) for e in range(end - 1, start, -1)]

    def _shorter(self, store: Store, index: int) -> tuple[int, bytes, Where] | None:
        """The longest stored chunk that starts where chunk ``index`` starts and ends before it does: a near
        one (every record there) first, else the longest a far tier holds the probe record of."""
        asked_far = self._first_shorter if index == 0 else None
        named = asked_far[0] if asked_far is not None else self._shorter_named(index)
        if not named:
            return None
        near = store.contains_many([self.names.probe_key(h) for _, h in named], shared_only=True, bounded=False,
                                   reach="near")
        for (e, h), hit in zip(named, near, strict=True):
            if hit and all(store.contains_many(self.names.record_keys(h), shared_only=True, bounded=False,
                                               reach="near")):
                return e, h, Where.NEAR
        if asked_far is not None:
            far = asked_far[1]  # asked with the chunks
        else:
            far = store.contains_many([self.names.probe_key(h) for _, h in named], shared_only=True,
                                      bounded=False, reach="far")
        for (e, h), hit in zip(named, far, strict=True):
            if hit:
                return e, h, Where.FAR
        return None


class ProbeThreads:
    """A few daemon threads that run probes in arrival order. Started here, with the far lookups: the first
    probe is submitted on the scheduling thread, which must not wait for a thread to start."""

    def __init__(self, store: Store, threads: int = PROBE_THREADS) -> None:
        self.store = store
        self._threads: WorkerThreads[Probe] = WorkerThreads(self._run, "tiercache-kv-lookup", threads)
        self._threads.start()
        #: set each time a probe is in (`wait_for_one`)
        self._finished = threading.Event()

    def submit(self, probe: Probe) -> None:
        self._threads.put(probe)

    def wait_for_one(self, timeout: float) -> None:
        """Wait until a probe comes in (any, since the last wait) or ``timeout`` passes."""
        self._finished.wait(timeout)
        self._finished.clear()

    def _run(self, probe: Probe) -> None:
        try:
            probe.run(self.store)
        except Exception:  # a store bug: the request's far chunks are misses, never a dead thread
            log.exception("TieredKVConnector: a lookup failed; its request is computed without the far tiers")
            probe.found = [Where.RESIDENT if r else Where.MISSING for r in probe.resident]
            probe.where = up_to_first_missing(probe.found)
        finally:
            probe.done.set()
            self._finished.set()

    def close(self) -> None:
        self._threads.close()


def up_to_first_missing(where: Sequence[Where]) -> list[Where]:
    """``where`` with every chunk after the first missing one missing too: a hit is a prefix."""
    cut = next((i for i, w in enumerate(where) if w == Where.MISSING), len(where))
    return list(where[:cut]) + [Where.MISSING] * (len(where) - cut)
