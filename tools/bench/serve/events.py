"""`tiercache bench serve --events`: does a router's index promise only what the connector then loads?

A case runs with vLLM's KV event publisher on (``--kv-events-config``, zmq) and NVIDIA Dynamo's standalone
indexer subscribed to it (`router_index`), so the trace pays whatever the events cost. After the trace,
the audit resends every distinct prompt of the run, one at a time, on the quiet server: first it asks the
indexer how many tokens this instance holds for the prompt (its longest match on any tier, GPU included:
Dynamo's tiers are cumulative), then it sends the prompt (one answer token) and reads how many prompt
tokens vLLM did not compute (``cached_tokens``: its own prefix cache plus the connector's load).

Before each question the index must show the previous resend on the GPU (vLLM publishes a step's
events before it answers, but Dynamo ingests on one thread of a busy machine), then a short settle lets
the tiers' own events of that step out: the memory tier's residency and a disk confirmation go out a
step later, so with a memory tier smaller than the run and no disk, a just-evicted chunk may still show
as promised. A prompt's last token is always computed, so what the index promises is its match capped at
the prompt's last full block before that token. Over-promised blocks are promised blocks the resend then
computed (a router sent the request for a prefix that was not there; "tiers" counts those beyond what
vLLM's own GPU events promised); under-announced blocks are blocks the resend reused that the index did
not show (a router scored this instance too low). The first is the issue's "0 announced blocks that a
resend then fails to load"; the second shows that the index keeps up.

Why one at a time after the trace, not during it: under concurrency an index answer and the request it
routes are separated by other requests' steps, so a record a tier evicts in between is a race any router
has, not an index that over-promises. The resend itself changes the tiers only by what it reuses (the
connector saves chunks it does not hold yet), so each question is asked after the previous resend's
events went out (a short settle).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from vllm_tiercache.tools.bench.pd.client import promised_tokens
from vllm_tiercache.tools.bench.router_index import DynamoIndexer, chat_token_ids, complete
from vllm_tiercache.tools.bench.serve.trace import Workload, messages_for

#: Seconds between a resend's answer and the next question, besides waiting for the index to show the
#: resent prompt on the GPU: the tiers' own events (memory residency, a DISK confirmation) go out a step later.
SETTLE_S = 0.3
#: The longest wait for Dynamo's indexer to show a resent prompt (it ingests on one thread of a busy machine).
CATCH_UP_S = 10.0


@dataclass
class EventsAudit:
    """What the index promised against what the resends reused, over one case's distinct prompts."""

    prompts: int = 0
    #: prompts the index matched past what vLLM's own GPU blocks explain (the tiers' events at work)
    tier_matched_prompts: int = 0
    promised_blocks: int = 0
    #: of those, beyond the GPU's match: what only the connector's events promised
    tier_promised_blocks: int = 0
    #: of those, beyond the host tier's match too: what only disk / Redis (``DISK``, ``STORAGE``) promised
    lower_tier_promised_blocks: int = 0
    reused_blocks: int = 0
    over_promised_blocks: int = 0
    #: of those, beyond what vLLM's own GPU events promised: the connector's events' share
    over_promised_by_tiers: int = 0
    over_promised_prompts: int = 0
    under_announced_blocks: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def audit_prompts(base_url: str, model: str, indexer: DynamoIndexer, worker: int, prompts: list[list[int]], *,
                  block_size: int, allowed_ids: list[int] | None = None,
                  on_progress: Callable[[int, EventsAudit], None] | None = None) -> EventsAudit:
    """Ask, resend, compare, for each prompt in turn (see the module docstring)."""
    out = EventsAudit()
    start = time.monotonic()
    previous: list[int] | None = None
    for i, tokens in enumerate(prompts):
        time.sleep(SETTLE_S)
        if previous is not None:  # the index has taken the last resend's GPU blocks in
            indexer.wait_matched(previous, worker, promised_tokens(len(previous), block_size), CATCH_UP_S)
        previous = tokens
        tiers = indexer.query(tokens).get(worker, {})
        matched = max(tiers.values(), default=0)
        limit = promised_tokens(len(tokens), block_size)
        promised = min(matched, limit)
        on_gpu = min(tiers.get("gpu", 0), limit)
        on_host = min(max(tiers.get("cpu", 0), on_gpu), limit)
        reused = complete(base_url, model, tokens, max_tokens=1, allowed_ids=allowed_ids).cached_tokens
        out.prompts += 1
        out.tier_matched_prompts += promised > on_gpu
        out.promised_blocks += promised // block_size
        out.tier_promised_blocks += (promised - on_gpu) // block_size
        out.lower_tier_promised_blocks += (promised - on_host) // block_size
        out.reused_blocks += reused // block_size
        over = -(-max(0, promised - reused) // block_size)
        out.over_promised_blocks += over
        out.over_promised_by_tiers += -(-max(0, promised - max(reused, on_gpu)) // block_size)
        out.over_promised_prompts += over > 0
        out.under_announced_blocks += max(0, reused - promised) // block_size
        if on_progress is not None:
            on_progress(i + 1, out)
    out.seconds = time.monotonic() - start
    return out


def audit_case(case: str, base_url: str, model: str, indexer: DynamoIndexer, workloads: list[Workload],
               answers: dict[tuple[int, int, int], str], *, block_size: int, allowed_ids: list[int] | None,
               line: Callable[[str], None]) -> EventsAudit:
    """Every distinct prompt of a case's run (its answered requests, rebuilt with their answers), audited
    against the index, with progress lines."""
    messages = []
    for workload in workloads:
        for session in workload.sessions:
            said = [answers.get((workload.level, session.index, turn)) for turn in range(len(session.questions))]
            for turn in range(len(session.questions)):
                if said[turn] is None:
                    break
                messages.append(messages_for(workload, session, turn, [str(a) for a in said[:turn]]))
    prompts = distinct_chat_prompts(base_url, model, messages)
    line(f"case {case}: events audit of {len(prompts)} distinct prompts, one at a time")
    step = max(1, len(prompts) // 4)

    def on_progress(done: int, so_far: EventsAudit) -> None:
        if done % step == 0 and done < len(prompts):
            line(f"  {case} audit: {done}/{len(prompts)} prompts, over-promised {so_far.over_promised_blocks} "
                 f"blocks, under-announced {so_far.under_announced_blocks}")

    result = audit_prompts(base_url, model, indexer, 1, prompts, block_size=block_size, allowed_ids=allowed_ids,
                           on_progress=on_progress)
    line(f"case {case}: events audit: {result.promised_blocks} blocks promised ({result.tier_promised_blocks} by "
         f"the tiers alone, {result.lower_tier_promised_blocks} by disk / Redis alone), "
         f"{result.over_promised_blocks} over-promised, {result.under_announced_blocks} under-announced")
    return result


def distinct_chat_prompts(base_url: str, model: str, messages: list[list[dict[str, Any]]]) -> list[list[int]]:
    """The token ids of each chat prompt, first occurrence order, duplicates dropped."""
    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    for msgs in messages:
        tokens = chat_token_ids(base_url, model, msgs)
        if tuple(tokens) not in seen:
            seen.add(tuple(tokens))
            out.append(tokens)
    return out


def format_audits(audits: dict[str, EventsAudit]) -> str:
    """One row per case: the index's promises against the resends' reuse."""
    head = (f"{'case':<20} {'prompts':>7} {'tier-matched':>12} {'promised':>9} {'by tiers':>9} {'by lower':>9} "
            f"{'reused':>7} {'over-promised':>13} {'under-announced':>15} {'seconds':>8}")
    lines = ["KV events audit (blocks; Dynamo's indexer asked before each resend, one prompt at a time; "
             "by tiers: promised past vLLM's GPU blocks, by lower: past the host tier too):", head]
    for case, a in audits.items():
        lines.append(f"{case:<20} {a.prompts:>7} {a.tier_matched_prompts:>12} {a.promised_blocks:>9} "
                     f"{a.tier_promised_blocks:>9} {a.lower_tier_promised_blocks:>9} {a.reused_blocks:>7} "
                     f"{f'{a.over_promised_blocks} ({a.over_promised_by_tiers} tiers)':>13} "
                     f"{a.under_announced_blocks:>15} {a.seconds:>8.1f}")
    return "\n".join(lines)
