"""What the KV scheduler side remembers per request, and how it turns that into one step's loads and saves.

Why apart from `vllm_tiercache.kvcache.scheduler`: the scheduler side decides *whether* a request is
looked up, hit or planned this step; this module holds the arithmetic of *which* blocks a planned request
loads and saves (per KV cache group, per chunk), which tests and the per-step cost depend on and which
reads nothing but the request's state, the naming and the block table. The chunk names in the plan come
from the request's `vllm_tiercache.kvcache.naming.RequestNames`, the one place chunks are named.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_tiercache.kvcache.groups import KVGroup, KVGroups
from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming, RequestNames
from vllm_tiercache.kvcache.plan import ChunkLoad, ChunkSave
from vllm_tiercache.shared.vllm_compat import publishable_block_count

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: vLLM's null block (`BlockPool.null_block`, the pool's first block): a table entry vLLM keeps no KV in
NULL_BLOCK_ID = 0


@dataclass
class RequestState:
    """What the scheduler side knows of one request between its lookup and its last step."""

    request: Request
    #: the request's chunk names and record keys, every salt applied (the one naming rule)
    names: RequestNames
    #: (end block, name) of each chunk of the prompt (`RequestNames.prompt_chunks`): what a lookup asks about
    chunks: list[tuple[int, bytes]] = field(default_factory=list)
    #: chunk index -> present in the store at lookup time (those are never written again)
    stored: list[bool] = field(default_factory=list)
    #: chunk index -> held by the workers' memory tier at lookup time (the rest come from shared tiers)
    resident: list[bool] = field(default_factory=list)
    #: blocks [load_first, load_end) are to be loaded in the request's next scheduled step
    load_first: int = 0
    load_end: int = 0
    #: end block of every stored chunk the load reads from, and whether the workers' memory holds it
    load_chunks: list[tuple[int, bool]] = field(default_factory=list)
    #: no chunk ending at or before this block is considered for saving again: planned, or found stored
    saved_until: int = 0
    #: end block of the last chunk planned for saving; a new lookup, which may find the chunks passed over
    #: as stored gone (evicted while the request was preempted), moves `saved_until` back here
    planned_until: int = 0
    #: no chunk can be saved before the request has this many computed blocks (0: not known yet);
    #: lets a decode step pass over the request without planning (`KVSchedulerSide.build_connector_meta`)
    next_save_block: int = 0
    #: False: the request is never looked up and never saved (`KVSchedulerSide.request_cacheable`)
    cacheable: bool = True
    #: a producer's hand-off promise the request carries, once checked (`vllm_tiercache.kvcache.handoff.promise`):
    #: None not checked yet, False none or unusable
    handoff: object = None
    #: the planned load is that promise's: asynchronous, and it waits for records still in flight
    handoff_load: bool = False
    #: the share of the prompt already computed at the request's first step (vLLM's prefix cache and the
    #: store's hits); its saves carry it to the slower tiers' admission (`ChunkSave.reused_share`)
    reused_share: float | None = None

    def found(self, stored: list[bool], resident: list[bool]) -> None:
        """A lookup (or a hand-off's promise) says what is stored, per chunk, and what the workers' memory holds:
        what is stored may have changed since the last one, so saving is planned again from the last chunk
        planned (`planned_until`), and any load planned before is dropped."""
        self.stored, self.resident = stored, resident
        self.saved_until, self.next_save_block = self.planned_until, 0
        self.forget_load()

    def forget_load(self) -> None:
        """No load planned any more (it was planned into a step, or the lookup's hit was not used)."""
        self.load_first = self.load_end = 0
        self.load_chunks = []
        self.handoff_load = False


def true_prefix(flags: list[bool]) -> int:
    """How many of ``flags`` are True before the first False (a hit is a prefix of chunks): C-speed list methods,
    since it runs per request answered on the scheduling thread."""
    return flags.index(False) if False in flags else len(flags)


def prompt_full_blocks(request: Request, block_size: int) -> int:
    """The prompt's full blocks that vLLM has hashed: the blocks chunks are cut from."""
    return min(request.num_prompt_tokens // block_size, len(request.block_hashes))


def group_loads(state: RequestState, group: KVGroup, block_ids: list[int], geometry: ChunkGeometry) -> list[ChunkLoad]:
    """One group's loads for the planned hit: full attention every block of [load_first, load_end), a
    sliding window only the blocks vLLM allocated inside the window at the hit's end.

    Runs on vLLM's scheduling thread once per chunk of every hit it admits (32 hits of 2K tokens are 512
    chunks in one step), so what does not change per chunk is read once, before the loop."""
    loads = []
    load_end = state.load_end
    low = group.load_first(state.load_first, load_end)
    chunk_start, record_start = geometry.chunk_start, group.record_start
    index, name = group.index, state.names.name
    tenant = getattr(state.request, "cache_salt", None)
    for end, _ in state.load_chunks:
        start = record_start(chunk_start(end), end)
        first = start if start > low else low
        last = end if end < load_end else load_end
        if last <= first:
            continue
        ids = block_ids[first:last]
        if len(ids) != last - first or NULL_BLOCK_ID in ids:
            raise RuntimeError(
                f"TieredKVConnector: group {index} of request {state.request.request_id} has no "
                f"block for [{first}, {last}) of its hit; vLLM allocated {block_ids[:last]}"
            )
        # by position, in the fields' order (chunk_hash, chunk_start, first, end, block_ids, group, tenant):
        # keywords cost a third more here
        loads.append(ChunkLoad(name(end), start, first, last, ids, index, tenant))
    return loads


def chunk_saves(
    name: bytes, end: int, groups: KVGroups, geometry: ChunkGeometry, block_ids: tuple[list[int], ...],
    parent: bytes | None = None,
) -> list[ChunkSave] | None:
    """The saves of the chunk named ``name`` that ends at block ``end``, one per KV cache group; None when
    vLLM already let a group's blocks go (a sliding window past the chunk): the chunk is not saved at all.
    ``parent``: the name of the chunk before (`RequestNames.parent_name`), its records' parent."""
    start = geometry.chunk_start(end)
    saves = []
    for group in groups.groups:
        first = group.record_start(start, end)
        ids = block_ids[group.index][first:end]
        if len(ids) != end - first or NULL_BLOCK_ID in ids:
            return None
        saves.append(ChunkSave(chunk_hash=name, block_ids=ids, group=group.index, first=first, parent_hash=parent))
    return saves


def chunks_to_save(
    state: RequestState, computed_after: int, naming: KVNaming, *, save_decode: bool, volatile_decode_tail: bool
) -> list[int]:
    """End blocks of chunks whose KV is complete after this step and not yet stored or planned.

    Only publishable blocks count (`vllm_tiercache.shared.vllm_compat.publishable_block_count`: vLLM may hash blocks
    whose drafter KV is not materialized yet), and with ``volatile_decode_tail`` a decoding request's
    last full chunk past the prompt waits for the next one (the rule vLLM's OffloadingConnector
    follows for EAGLE groups).

    Runs on every step that loads for the request or reaches its `next_save_block`, so it only looks at
    chunk ends past `saved_until` (constant time once a request's chunks are planned, whatever the
    prompt's length). Chunks found stored at lookup are passed over for good: `saved_until` moves past them here,
    and past every chunk it returns. Sets `next_save_block`, below which a step plans nothing.
    """
    request = state.request
    geometry = naming.geometry
    block_size = geometry.block_size
    per_chunk = geometry.blocks_per_chunk
    prompt_blocks = prompt_full_blocks(request, block_size)
    limit = len(request.block_hashes) if save_decode else prompt_blocks
    limit = min(limit, publishable_block_count(request))
    computed_blocks = min(computed_after // block_size, limit)
    ends = list(range(geometry.next_full_end(state.saved_until), computed_blocks + 1, per_chunk))
    if ends and volatile_decode_tail and computed_after > request.num_prompt_tokens:
        volatile_end = computed_blocks // per_chunk * per_chunk
        ends = [end for end in ends if end != volatile_end or end <= prompt_blocks]
    # The partial last chunk, if the naming stores one, once the whole prompt is computed.
    partial = naming.stored_partial_end(prompt_blocks)
    if partial is not None and computed_after >= request.num_prompt_tokens and (
        state.saved_until < partial <= computed_blocks
    ):
        ends.append(partial)  # never among the full chunk ends above
    stored = state.stored
    to_save = []
    for end in ends:
        index = (end - 1) // per_chunk  # the chunk's index among the prompt's chunk ends
        if not (end <= prompt_blocks and index < len(stored) and stored[index]):
            to_save.append(end)
    if ends:
        state.saved_until = max(state.saved_until, *ends)
    if to_save:
        state.planned_until = max(state.planned_until, *to_save)
    # The next chunk end past saved_until that could ever be saved (a volatile tail left for the
    # next step is one: it is not past the computed blocks, so the next step plans again).
    next_full = geometry.next_full_end(state.saved_until)
    if next_full > request.num_prompt_tokens // block_size and not save_decode:
        next_full = sys.maxsize  # the prompt's full chunks are all planned or stored
    pending_partial = partial is not None and partial > state.saved_until
    state.next_save_block = min(next_full, partial) if pending_partial else next_full
    return to_save
