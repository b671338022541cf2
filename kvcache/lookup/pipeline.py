"""How much of a waiting request's prompt the store supplies now: name its chunks, ask the tiers, plan the hit.

The one pipeline `KVSchedulerSide.get_num_new_matched_tokens` hands a request to (after a prefill/decode
hand-off's promise, which is loaded without a lookup). Where the store has a far tier, the asking happens off
the scheduling thread (`vllm_tiercache.kvcache.lookup.far`) and the answer may be None, "ask me again next
step"; otherwise one batched call here asks the shared tiers (disk, GDS, and Redis or the object tier bounded
by ``lookup_budget_ms``). Either way the hit is planned the same: the longest prefix of loadable chunks (under
vLLM's hybrid KV cache manager, the longest whose end every sliding-window group can supply), then a shorter
stored chunk inside the first missing one (a prompt that extends a stored one), one token short of the prompt.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm_tiercache.kvcache.events.tracker import TierEventTracker
from vllm_tiercache.kvcache.lookup.far import FarLookups
from vllm_tiercache.kvcache.naming import KVNaming
from vllm_tiercache.kvcache.planning import RequestState, true_prefix
from vllm_tiercache.shared.residency import ResidentSet
from vllm_tiercache.shared.store.api import Store

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class PromptLookup:
    """The scheduler side's lookups: one per waiting request (module docstring)."""

    def __init__(self, *, store: Store, naming: KVNaming, resident: ResidentSet[bytes], failed: dict[bytes, None],
                 events: TierEventTracker | None, can_load: bool, whole_request_loads: bool, deadline_s: float) -> None:
        """``resident``: what the workers' memory tier holds (their reports); ``failed``: chunks a load could not
        use (the scheduler side's, shared); ``deadline_s``: > 0, far tiers are looked up and fetched ahead off
        the scheduling thread, a request waiting at most this long (`far_lookups`)."""
        self.store = store
        self.naming = naming
        self.geometry = naming.geometry
        self.groups = naming.groups
        self.resident = resident
        self.failed = failed
        #: this step's findings for the KV events tracker (`announce`): per looked-up request, the request, its
        #: names, and per chunk its end, stored, resident, asked (None: vLLM publishes no events)
        self.findings: list[tuple[Request, Any, list[int], list[bool], list[bool], list[bool]]] | None = (
            [] if events is not None else None)
        self.events = events
        self.can_load = can_load
        self.whole_request_loads = whole_request_loads
        #: vLLM's block manager (`KVSchedulerSide.bind_kv_cache_manager`): its prefix cache is never fetched
        self.kv_cache_manager: Any = None
        self.far = far_lookups(store, naming, resident, deadline_s, can_load=can_load, failed=failed,
                               whole_request_loads=whole_request_loads, local_blocks=self.vllm_holds)

    def vllm_holds(self, request: Request) -> int:
        """The blocks of ``request`` vLLM's own prefix cache holds now (never fetched from a far tier)."""
        manager = self.kv_cache_manager
        if manager is None:
            return 0
        try:
            hit_tokens = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[1]
        except Exception:  # another vLLM's internals: fetch everything found rather than fail
            return 0
        return int(hit_tokens) // self.geometry.block_size

    def matched(self, state: RequestState, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the store supplies past vLLM's own ``num_computed_tokens``, whether vLLM waits for their load
        as a whole), or (None, False) while a far lookup is pending."""
        request = state.request
        block_size = self.geometry.block_size
        shorter: tuple[int, bool] | None = None
        if self.far is not None:
            answer = self.far.answer(state, num_computed_tokens // block_size)
            if answer is None:
                return None, False  # asked again next step; the others are scheduled meanwhile
            ends, full_ok, resident, shorter, stored = (answer.ends, answer.usable, answer.resident,
                                                        answer.shorter, answer.stored)
            window_ok, host, asked = [True] * len(ends), answer.host, answer.asked
        else:
            ends, full_ok, window_ok, resident = self._ask(state)
            stored, host = [f and w for f, w in zip(full_ok, window_ok, strict=True)], resident
            asked = [not r for r in resident]
        state.found(stored, resident)
        if self.findings is not None:
            self.findings.append((request, state.names, ends, stored, resident, asked))
        if not self.can_load:
            return 0, False
        # the full-attention prefix, then the longest part of it whose end every window group can supply
        full_chunks = true_prefix(full_ok)
        hit_chunks = full_chunks
        while hit_chunks and not self._windows_ok(ends, window_ok, ends[hit_chunks - 1]):
            hit_chunks -= 1
        chunks = [(end, host[i]) for i, end in enumerate(ends[:hit_chunks])]
        if hit_chunks == full_chunks and hit_chunks < len(ends):
            if self.far is None:
                shorter = self._shorter_chunk(state, self.geometry.chunk_start(ends[hit_chunks]), ends[hit_chunks])
            elif shorter is not None and self.geometry.chunk_start(shorter[0]) != self.geometry.chunk_start(
                    ends[hit_chunks]):
                shorter = None  # found inside a chunk the far lookup had; now short of it
            if shorter is not None and self._windows_ok(ends[:hit_chunks], window_ok, shorter[0]):
                chunks.append(shorter)
        if not chunks:
            return 0, False
        # vLLM must compute at least the last prompt token itself, so a hit stops one token short.
        usable_blocks = (request.num_prompt_tokens - 1) // block_size
        hit_blocks = min(chunks[-1][0], usable_blocks)
        local_blocks = num_computed_tokens // block_size
        if hit_blocks <= local_blocks:
            return 0, False
        state.load_first, state.load_end, state.load_chunks = local_blocks, hit_blocks, chunks
        return (hit_blocks - local_blocks) * block_size, self.whole_request_loads

    def _ask(self, state: RequestState) -> tuple[list[int], list[bool], list[bool], list[bool]]:
        """Per chunk of the prompt's full blocks: its end block, are its full-attention records loadable
        now, are its sliding-window records (True for a model without such groups), and does the workers'
        memory hold it all? One batched store call."""
        names, chunks = state.names, state.chunks
        failed = [name in self.failed for _, name in chunks]
        resident = [name in self.resident and not bad for (_, name), bad in zip(chunks, failed, strict=True)]
        full_ok, window_ok = list(resident), list(resident)
        missing = [i for i, hit in enumerate(resident) if not hit and not failed[i]]
        if missing:
            full, sliding = self.groups.full, self.groups.sliding
            per_chunk = [
                (names.record_keys(chunks[i][1], full), names.record_keys(chunks[i][1], sliding)) for i in missing
            ]
            flat = [key for keys in per_chunk for part in keys for key in part]
            found = self.store.contains_many(flat, shared_only=True)
            offset = 0
            for i, (full_keys, window_keys) in zip(missing, per_chunk, strict=True):
                full_ok[i] = all(found[offset : offset + len(full_keys)])
                offset += len(full_keys)
                window_ok[i] = all(found[offset : offset + len(window_keys)])
                offset += len(window_keys)
        return [end for end, _ in chunks], full_ok, window_ok, resident

    def announce(self) -> None:
        """Hand the findings of the lookups since the last call to the KV events tracker (a stored chunk is
        announced where it was found, one found gone withdrawn): at the start of each step's plan, ahead of
        its saves, and when vLLM takes the step's events. Not on the lookup's way: vLLM publishes events once
        per step anyway."""
        if not self.findings or self.events is None:
            return
        findings, self.findings = self.findings, []
        for finding in findings:
            self.events.looked_up(*finding)

    def _windows_ok(self, ends: list[int], window_ok: list[bool], end: int) -> bool:
        """Can every sliding-window group supply a hit ending at block `end` (or one block before it)?
        It needs the records of the chunks that overlap `[end - window_blocks - 1, end)`."""
        if not self.groups.sliding:
            return True
        low = end - self.groups.max_window_blocks - 1
        return all(ok for chunk_end, ok in zip(ends, window_ok, strict=False) if low < chunk_end < end + 1)

    def _shorter_chunk(self, state: RequestState, start: int, end: int) -> tuple[int, bool] | None:
        """The longest stored chunk that starts at block `start` and ends before `end`, if any.

        A chunk is named by the hash at its last block, so a prompt that extends a stored prompt (a RAG
        question after a precomputed document) finds the document's partial last chunk only by probing
        the shorter endings: first on layer 0 of rank 0 for every candidate in one call, then on every
        layer and rank of the best candidate. A chunk a load could not use is no candidate (else a record
        the workers always reject, e.g. of another chunk size, would be claimed, failed and recomputed on
        every lookup of the request).
        """
        names = state.names
        named = [(e, names.name(e)) for e in range(end - 1, start, -1)]
        named = [(e, h) for e, h in named if h not in self.failed]
        if not named:
            return None
        for e, h in named:
            if h in self.resident:
                return e, True
        probed = self.store.contains_many([names.probe_key(h) for _, h in named], shared_only=True)
        for (e, h), hit in zip(named, probed, strict=True):
            if hit and all(self.store.contains_many(names.record_keys(h), shared_only=True)):
                return e, False
        return None


def far_lookups(store: Store, naming: KVNaming, resident: ResidentSet[bytes], deadline_s: float, *, can_load: bool,
                failed: dict[bytes, None], whole_request_loads: bool, local_blocks: Any) -> FarLookups | None:
    """The far lookups of a store with a far tier, or None (lookups on the scheduling thread), saying why at start."""
    far_tiers = [t.name for t in getattr(store, "far_tiers", [])]
    if deadline_s <= 0 or not far_tiers or not can_load:
        return None
    if whole_request_loads:
        log.warning("TieredKVConnector: far tiers %s are looked up on the scheduling thread (bounded by "
                    "lookup_budget_ms) and read in the forward pass: this model's KV cache groups are loaded as one "
                    "whole-request load", far_tiers)
        return None
    log.info("TieredKVConnector: far tiers %s: looked up off the scheduling thread and fetched into host memory "
             "before a request's turn, waiting at most %.0f ms", far_tiers, deadline_s * 1000)
    return FarLookups(store, resident, deadline_s, local_blocks=local_blocks, ranks=len(naming.identities),
                      failed=failed)
