"""The demo's client side: a Zipf trace of RAG queries, sent one at a time through the `openai` client.

Why one at a time: time to first token is what a cache changes; with concurrent requests on a 2-core
machine the numbers would mostly measure queueing. Why Zipf: in RAG traffic a few documents are asked
about far more often than the rest, which is what makes the memory tier worth having.

TTFT is read from the stream: vLLM's chat endpoint sends its first chunk (the role) only after the
engine produced the first token, so the first chunk's arrival is the first token's.
"""

from __future__ import annotations

import base64
import random
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_tiercache.tools.demo.corpus import QUESTIONS, Document
from vllm_tiercache.tools.demo.prompts import build_prompt


@dataclass(frozen=True)
class Query:
    """One request of the trace: which document, which question, and whether it is a page-only question."""

    doc: int
    question: str
    visual: bool = False


@dataclass
class Result:
    """What one request gave: TTFT, prompt tokens, cached prompt tokens (tiercache's hits), or an error."""

    query: Query
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def zipf_trace(n_docs: int, n_queries: int, *, alpha: float = 1.1, visual_every: int = 4, seed: int = 0
               ) -> list[Query]:
    """`n_queries` queries; document i is picked with weight 1/(i+1)^alpha (document 0 is the most popular).

    Every `visual_every`-th query (0: none) is a page-only question: the image and a short question,
    no document text. Such a prompt has no precomputed KV prefix, so its encoder output has to come from
    the encoder cache: it is the part of the trace where `TieredECConnector` serves.
    """
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** alpha for i in range(n_docs)]
    docs = rng.choices(range(n_docs), weights=weights, k=n_queries)
    out = []
    for k, doc in enumerate(docs):
        visual = bool(visual_every) and k % visual_every == visual_every - 1
        question = "Describe the chart on this page." if visual else rng.choice(QUESTIONS)
        out.append(Query(doc, question, visual))
    return out


def _data_url(doc: Document) -> str:
    return "data:image/png;base64," + base64.b64encode(doc.image_path.read_bytes()).decode()


def run_queries(base_url: str, model: str, docs: list[Document], trace: list[Query], *, max_tokens: int = 8,
                on_result: Any = None) -> list[Result]:
    """Send the trace in order (one request in flight), streaming each answer; never raise on a bad request."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="tiercache-demo", timeout=120.0, max_retries=0)
    urls = {d.index: _data_url(d) for d in docs}
    texts = {d.index: d.text for d in docs}
    results = []
    for query in trace:
        text = f"Question: {query.question}\nAnswer:" if query.visual else build_prompt(texts[query.doc],
                                                                                         query.question)
        result = Result(query)
        start = time.perf_counter()
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": urls[query.doc]}},
                    {"type": "text", "text": text},
                ]}],
                max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},  # random weights: an early EOS would end the answer at once
            )
            for chunk in stream:
                if result.ttft_s is None and chunk.choices:
                    result.ttft_s = time.perf_counter() - start
                if chunk.usage is not None:
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    result.cached_tokens = int(getattr(details, "cached_tokens", 0) or 0) if details else 0
            result.total_s = time.perf_counter() - start
            if result.ttft_s is None:
                result.error = "the stream ended without a token"
        except Exception as exc:  # one failed request is a row in the report, not a crash of the demo
            result.error = f"{type(exc).__name__}: {exc}"
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
