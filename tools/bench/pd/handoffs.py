"""`tiercache bench pd --handoffs N`: many hand-offs through the proxy, counted and checked, not timed.

Why: one slow or lost hand-off in a few is what an operator meets first (a decode that recomputes the
whole prompt while nothing says so), and a handful of prompts cannot show a rate of one in fifty. So N
fresh prompts go through `tiercache pd-proxy` one after another, as vLLM's disaggregated-prefill proxy
sends them (one token and ``do_remote_decode`` to the producer, then the request with its
``kv_transfer_params`` to the consumer), and the run reports from the consumer's `/metrics`:

- the prompt tokens it took from the store against the tokens the producer promised (every full block
  short of each prompt's last token: the consumer always computes that one), as a share;
- hand-offs received and loaded, fallbacks (counted, each logged with its request id), and the tokens
  not taken *without* a fallback counted: silent recomputes, which must be 0;
- whether each decoded answer equals the plain server's greedy answer to the same prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm_tiercache.tools.bench.pd.client import complete, metric_sum, promised_tokens

#: The consumer's counters read before and after the run (vllm:tiercache_kv_<name>_total).
COUNTERS = ("hit_tokens", "handoffs_received", "handoff_loads", "handoff_fallbacks", "handoff_missing_records",
            "handoffs_rejected")
ANSWER_TOKENS = 8


def _counters(metrics_text: str) -> dict[str, float]:
    return {name: metric_sum(metrics_text, f"vllm:tiercache_kv_{name}_total") for name in COUNTERS}


def _answer(url: str, served: str, tokens: list[int]) -> str:
    _, answer = complete(url, tokens, served=served, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    return str(answer["choices"][0]["text"])


def run_handoffs(*, plain: Any, producer: Any, consumer: Any, served: str, lengths: list[int], count: int,
                 prompt: Callable[[int], list[int]], block_size: int,
                 progress: Callable[[str], None]) -> dict[str, Any]:
    """Send ``count`` prompts (lengths in turn) through the proxy; the counted report (module docstring)."""
    from vllm_tiercache.tools.pd_proxy import running_proxy

    before = _counters(consumer.metrics())
    promised = identical = 0
    with running_proxy([producer.base_url], [consumer.base_url]) as proxy:
        for i in range(count):
            length = lengths[i % len(lengths)]
            tokens = prompt(length)
            decoded = _answer(proxy, served, tokens)
            identical += decoded == _answer(plain.base_url, served, tokens)
            promised += promised_tokens(length, block_size)
            if (i + 1) % max(1, count // 10) == 0:
                progress(f"{i + 1}/{count} hand-offs")
    want = before["handoff_loads"] + before["handoff_fallbacks"] + count
    deadline = time.monotonic() + 120
    while True:  # the last steps' stats reach /metrics with a later engine step
        after = _counters(consumer.metrics())
        if after["handoff_loads"] + after["handoff_fallbacks"] >= want or time.monotonic() > deadline:
            break
        _answer(consumer.base_url, served, prompt(8))
        time.sleep(0.5)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    # the short settling prompts are never cached (shorter than a block): every hit token is a hand-off's
    taken = int(delta["hit_tokens"])
    return {"handoffs": count, "lengths": lengths, "promised_tokens": promised, "taken_tokens": taken,
            "taken_share": taken / promised if promised else None, "received": int(delta["handoffs_received"]),
            "loads": int(delta["handoff_loads"]), "fallbacks": int(delta["handoff_fallbacks"]),
            "missing_records": int(delta["handoff_missing_records"]), "rejected": int(delta["handoffs_rejected"]),
            "silent_recompute_tokens": max(0, promised - taken) if not delta["handoff_fallbacks"] else None,
            "identical_outputs": identical}


def format_handoffs(report: dict[str, Any]) -> str:
    r = report["handoff_run"]
    share = "n/a" if r["taken_share"] is None else f"{r['taken_share']:.2%}"
    silent = "n/a (fallbacks counted)" if r["silent_recompute_tokens"] is None else str(r["silent_recompute_tokens"])
    return "\n".join([
        f"tiercache bench pd --handoffs {r['handoffs']}: {report['model']}, prompts of {r['lengths']} tokens in turn, "
        f"through tiercache pd-proxy, over {report.get('redis', 'Redis')}; the consumer waits at most "
        f"{report['wait_ms']:.0f} ms",
        "",
        "| hand-offs | promised tokens | taken from the store | share | received | loaded | fallbacks "
        "| missing records | silent recompute tokens | outputs identical to the plain server |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {r['handoffs']} | {r['promised_tokens']} | {r['taken_tokens']} | {share} | {r['received']} | {r['loads']} "
        f"| {r['fallbacks']} | {r['missing_records']} | {silent} | {r['identical_outputs']}/{r['handoffs']} |",
        "",
        "Targets: share >= 99%, 0 silent recomputes, every output identical."])
