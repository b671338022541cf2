"""A small generator of Mooncake-format traces with the structure that makes prefix caching pay.

Why: tests must not read the published trace, and a sizing exercise needs a trace before production has
one. Each request is a shared system prompt (a few, Zipf-popular), then either a document (Zipf over a
corpus, popularity drifting over time) or a turn of a multi-turn conversation (the previous turn's whole
prompt plus the new turn), then a question of its own (one-off blocks). Block ids are interned per
(parent id, content), so ids follow the Mooncake rule: equal ids exactly where prefixes are equal.
"""

from __future__ import annotations

import random

from vllm_tiercache.tools.bench.trace.mooncake import BLOCK_TOKENS, TraceRequest


class _Interner:
    """Block ids by (parent id, content label): a block's id names it and everything before it."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def chain(self, labels: list[object]) -> list[int]:
        ids: list[int] = []
        parent = -1
        for label in labels:
            parent = self._ids.setdefault((parent, label), len(self._ids))
            ids.append(parent)
        return ids


def _zipf(rng: random.Random, n: int, exponent: float) -> int:
    """An index in [0, n) drawn with probability proportional to 1 / (index + 1) ** exponent."""
    weights = [1.0 / (i + 1) ** exponent for i in range(n)]
    return rng.choices(range(n), weights)[0]


def generate_trace(requests: int, *, seed: int = 0, system_prompts: int = 4, documents: int = 200,
                   doc_share: float = 0.6, turns: int = 6, rate_per_s: float = 4.0) -> list[TraceRequest]:
    """``requests`` requests: system prompt (2-4 blocks), then a document (8-40 blocks, ``doc_share`` of
    the requests) or a conversation turn (2-6 new blocks on the previous turn, up to ``turns`` turns), then
    a question (1-2 one-off blocks); arrivals are Poisson at ``rate_per_s``."""
    rng = random.Random(seed)
    interner = _Interner()
    sys_len = [rng.randint(2, 4) for _ in range(system_prompts)]
    doc_len = [rng.randint(8, 40) for _ in range(documents)]
    doc_order = list(range(documents))
    conversations: list[list[object]] = []  # live conversations: their labels so far (after the system prompt)
    out: list[TraceRequest] = []
    now = 0.0
    for index in range(requests):
        if index and index % max(1, requests // 4) == 0:  # popularity drifts: a new quarter, new favourites
            rng.shuffle(doc_order)
        system = _zipf(rng, system_prompts, 1.0)
        labels: list[object] = [("sys", system, i) for i in range(sys_len[system])]
        if rng.random() < doc_share:
            doc = doc_order[_zipf(rng, documents, 0.9)]
            labels += [("doc", doc, i) for i in range(doc_len[doc])]
        else:
            if conversations and rng.random() < 0.7:
                convo = conversations[rng.randrange(len(conversations))]
            else:
                convo = [("conv", index)]
                conversations.append(convo)
            convo.extend(("turn", index, i) for i in range(rng.randint(2, 6)))
            labels += convo
            if len(convo) > 6 * turns:
                conversations.remove(convo)
            if len(conversations) > 32:
                conversations.pop(0)
        labels += [("ask", index, i) for i in range(rng.randint(1, 2))]
        ids = interner.chain(labels)
        now += rng.expovariate(rate_per_s) * 1000.0
        out.append(TraceRequest(round(now, 3), len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS),
                                rng.randint(1, 400), tuple(ids)))
    return out
