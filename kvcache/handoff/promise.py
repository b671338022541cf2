"""Prefill/decode hand-off through the store: what a producer promises, and how a consumer checks it.

vLLM's disaggregated-prefill proxy sends a request to the prefill instance (``kv_role`` ``kv_producer``)
with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, then sends it to the decode
instance (``kv_consumer``) with whatever ``kv_transfer_params`` the prefill instance returned. Here the
records travel through the shared tiers of the store (Redis, a shared disk), so what the producer returns
is not an address but a promise that names the records, under the key `PARAMS_KEY`:

- ``v``: the format of the promise (`PROMISE_VERSION`); another one is ignored (a plain lookup);
- ``namespace``, ``chunk_size``: the producer's, which the consumer must share to name the same records;
- ``chunks``: how many of the prompt's chunks the producer stores (its full chunks, and the partial last
  one with ``save_partial_chunks``), ``tokens``: the prompt tokens they cover;
- ``last_chunk``: the hex name of the last of them. The consumer names the same prompt's chunks itself
  (`vllm_tiercache.kvcache.naming`, vLLM's block hashes): equal last names mean the same prompt, model,
  weights, adapter and salts, so the promise is for exactly the records it would look up;
- ``producer``: the producer's engine id, and ``tiers``: the kinds of its shared tiers (for logs).

Why a count and the last name, not every name: a chunk's name is vLLM's chain hash at its last block, so
the last name vouches for the whole prefix and the params stay a few hundred bytes for any prompt length.

The consumer (`HandoffPromise.parse`) loads exactly the promised prefix as one asynchronous load
(vLLM's ``load_kv_async``: the request waits in ``WAITING_FOR_REMOTE_KVS``, the batch goes on); the
worker waits at most ``handoff_wait_ms`` for records still on their way (`vllm_tiercache.kvcache.
handoff_wait`) and reports what did not arrive as failed blocks, which vLLM recomputes. A request without
a promise is looked up as before: a bounded lookup, best effort.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_tiercache.kvcache.naming import KVNaming, RequestNames
from vllm_tiercache.kvcache.planning import RequestState

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: The key of the connector's promise inside ``kv_transfer_params``.
PARAMS_KEY = "tiercache"
#: The promise's format; a consumer ignores a promise of another format (and counts it).
PROMISE_VERSION = 1


def wants_remote_decode(request: Request) -> bool:
    """The proxy asked this (prefill) request to hand its KV to a decode instance."""
    params = getattr(request, "kv_transfer_params", None)
    return bool(params) and bool(params.get("do_remote_decode"))


def remote_prefill_params(request: Request) -> dict[str, Any] | None:
    """The producer's promise a (decode) request carries, if any. Keyed on `PARAMS_KEY` alone, not on
    ``do_remote_prefill``: beside another connector in vLLM's MultiConnector, params of the other
    connector alone are no promise of ours (and no reason for a warning)."""
    params = getattr(request, "kv_transfer_params", None)
    promise = params.get(PARAMS_KEY) if params else None
    return promise if isinstance(promise, dict) else None


@dataclass
class HandoffCounters:
    """The scheduler side's hand-off counts between two stats reports (`take`)."""

    #: producer: promises returned to the proxy; consumer: promises accepted (their load is planned)
    handoffs_offered: int = 0
    handoffs_received: int = 0
    #: consumer: promises that could not be used (another format, namespace, chunk size or prompt): the
    #: request is looked up as without one
    handoffs_rejected: int = 0

    def take(self) -> dict[str, int]:
        data = {name: value for name, value in vars(self).items() if value}
        if data:
            self.__init__()  # type: ignore[misc]
        return data


def producer_params(names: RequestNames, naming: KVNaming, prompt_blocks: int, *, producer: str,
                    tiers: list[str]) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a producer returns for a prompt of ``prompt_blocks`` full blocks (None:
    no chunk to hand over, e.g. a prompt shorter than a block).

    With vLLM's own ``do_remote_prefill: true``: vLLM then counts the decode side's request as a P/D
    fetch and reports the producer's cached tokens. (vLLM's MultiConnector refuses two connectors' params
    with a common key, so beside a connector that sets those flags too, e.g. NixlConnector, it fails the
    request: docs/serving.md.)"""
    ends = naming.stored_chunk_ends(prompt_blocks)
    if not ends:
        return None
    geometry = naming.geometry
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        PARAMS_KEY: {
            "v": PROMISE_VERSION,
            "namespace": naming.namespace,
            "chunk_size": geometry.chunk_size,
            "chunks": len(ends),
            "tokens": ends[-1] * geometry.block_size,
            "last_chunk": names.name(ends[-1]).hex(),
            "producer": producer,
            "tiers": tiers,
        },
    }


@dataclass(frozen=True)
class HandoffPromise:
    """A producer's promise as a consumer checked it: the end blocks and names of the promised chunks."""

    ends: tuple[int, ...]
    producer: str
    names: tuple[bytes, ...] = ()

    @classmethod
    def parse(cls, promise: dict[str, Any], prompt_chunks: list[tuple[int, bytes]],
              naming: KVNaming) -> tuple[HandoffPromise | None, str]:
        """(the promise, "") when it names this request's own chunks under this naming, else (None, why).
        ``prompt_chunks``: (end block, name) of each chunk of the prompt (`RequestNames.prompt_chunks`); a
        partial last one is stored, and so promised, only with ``save_partial_chunks``
        (`KVNaming.stored_chunk_ends`)."""
        if promise.get("v") != PROMISE_VERSION:
            return None, f"promise format {promise.get('v')!r}, this build reads {PROMISE_VERSION}"
        if promise.get("namespace") != naming.namespace:
            return None, f"namespace {promise.get('namespace')!r}, this consumer's is {naming.namespace!r}"
        if promise.get("chunk_size") != naming.geometry.chunk_size:
            return None, (f"chunk_size {promise.get('chunk_size')!r}, this consumer's is "
                          f"{naming.geometry.chunk_size}")
        count = promise.get("chunks")
        chunks = prompt_chunks
        if chunks and chunks[-1][0] % naming.geometry.blocks_per_chunk and not naming.save_partial_chunks:
            chunks = chunks[:-1]
        if not isinstance(count, int) or isinstance(count, bool) or not 0 < count <= len(chunks):
            return None, f"{count!r} chunks promised, the prompt has {len(chunks)}"
        chunks = chunks[:count]
        last = promise.get("last_chunk")
        if not isinstance(last, str) or chunks[-1][1].hex() != last:
            return None, "the last promised chunk is not this prompt's (another prompt, model, adapter or salt)"
        return cls(tuple(end for end, _ in chunks), str(promise.get("producer", "?")),
                   tuple(name for _, name in chunks)), ""


def handoff_hit(state: RequestState, naming: KVNaming, counters: HandoffCounters, *, resident: Any,
                num_computed_tokens: int) -> tuple[int, bool] | None:
    """What a request's producer promised, planned as its load, or None when it carries no usable promise (it
    is looked up as any other). Every promised chunk is loaded, stored yet or not (the worker waits for the
    late ones), up to one token short of the prompt, and none is saved again: (tokens, True) for vLLM's
    ``load_kv_async``, or (0, False) when the engine's own prefix cache already holds as much."""
    promise = check_promise(state, naming, counters)
    if promise is None:
        return None
    block_size = naming.geometry.block_size
    usable_blocks = (state.request.num_prompt_tokens - 1) // block_size
    hit_blocks = min(promise.ends[-1], usable_blocks)
    local_blocks = num_computed_tokens // block_size
    state.found([True] * len(promise.ends), [])
    if hit_blocks <= local_blocks:
        return 0, False
    state.load_first, state.load_end = local_blocks, hit_blocks
    state.load_chunks = [(end, name in resident) for end, name in zip(promise.ends, promise.names, strict=True)]
    state.handoff_load = True
    return (hit_blocks - local_blocks) * block_size, True


def check_promise(state: RequestState, naming: KVNaming, counters: HandoffCounters) -> HandoffPromise | None:
    """The request's usable promise, checked once per request (a rejected one is logged and counted once)."""
    if state.handoff is None:
        raw = remote_prefill_params(state.request)
        state.handoff = False
        if raw is not None:
            promise, why = HandoffPromise.parse(raw, state.chunks, naming)
            if promise is None:
                counters.handoffs_rejected += 1
                log.warning("TieredKVConnector: request %s: the producer's kv_transfer_params are not usable "
                            "(%s); looking the prompt up as without them", state.request.request_id, why)
            else:
                state.handoff = promise
    return state.handoff if isinstance(state.handoff, HandoffPromise) else None
