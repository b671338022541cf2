"""`tiercache bench serve`: its trace, working set and ratios, and `--quick --events` end to end on the text
cases (the events audit: a real router's index against what resends reuse).

The end-to-end run is the real CLI entry in a subprocess (tests/tools/bench/serve/run.py says why); the
multimodal cases run in their own module (test_bench_serve_multimodal.py), so the two halves of
`--quick`'s five servers start on two workers side by side instead of one after another.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools.bench.serve.run import rows_checked, run_quick
from vllm_tiercache.tools.bench.serve.report import add_ratios
from vllm_tiercache.tools.bench.serve.trace import (
    kv_budget_tokens,
    make_workload,
    messages_for,
    render,
    working_set_tokens,
)


def test_workload_is_deterministic_and_levels_share_no_prefix() -> None:
    a = make_workload(1, n_docs=5, doc_tokens=100, sessions=6, turns=2, zipf_alpha=1.1, seed=3)
    b = make_workload(1, n_docs=5, doc_tokens=100, sessions=6, turns=2, zipf_alpha=1.1, seed=3)
    other = make_workload(4, n_docs=5, doc_tokens=100, sessions=6, turns=2, zipf_alpha=1.1, seed=3)
    assert a == b
    assert not set(a.docs) & set(other.docs)
    assert all(doc.isascii() for doc in a.docs)


def test_working_set_counts_shared_prefixes_once() -> None:
    # one document, two sessions of one turn: the document is counted once, each question once
    w = make_workload(0, n_docs=1, doc_tokens=200, sessions=2, turns=1, zipf_alpha=1.0, seed=0)
    total, longest = working_set_tokens(w, answer_tokens=4)
    one = render([{"role": "user", "content": f"{w.docs[0]}\n\nQuestion: {w.sessions[0].questions[0]}"}])
    assert longest >= len(one)
    assert len(one) + 4 < total < 2 * (len(one) + 4)


def test_multimodal_trace_sends_each_page_image_first_and_asks_about_some_pages_alone() -> None:
    images = ("data:image/png;base64,AAAA", "data:image/png;base64,BBBB")
    w = make_workload(2, n_docs=2, doc_tokens=50, sessions=4, turns=2, zipf_alpha=1.0, seed=1, images=images,
                      image_tokens=8, page_only_every=2)
    assert [s.page_only for s in w.sessions] == [False, True, False, True]
    for session in w.sessions:
        first = messages_for(w, session, 1, ["answer one"])[0]["content"]
        # the image comes with the first message, resent with the history on the next turn
        assert first[0] == {"type": "image_url", "image_url": {"url": images[session.doc]}}
        assert (w.docs[session.doc] in first[1]["text"]) is not session.page_only
    # the template sees only the text parts
    text_only = make_workload(2, n_docs=2, doc_tokens=50, sessions=4, turns=2, zipf_alpha=1.0, seed=1)
    session = text_only.sessions[0]
    assert render(messages_for(w, session, 1, ["a"])) == render(messages_for(text_only, session, 1, ["a"]))
    # each distinct image counts its tokens once in the working set, in front of its prompts
    plain, longest_plain = working_set_tokens(text_only, 4)
    no_page_only = make_workload(2, n_docs=2, doc_tokens=50, sessions=4, turns=2, zipf_alpha=1.0, seed=1,
                                 images=images, image_tokens=8)
    with_pages, longest = working_set_tokens(no_page_only, 4)
    assert longest == longest_plain + 8
    distinct_docs = len({s.doc for s in no_page_only.sessions})
    # (and the documents' common opening, shared as text, is not shared behind different images)
    assert plain + 8 * distinct_docs <= with_pages < plain + 8 * distinct_docs + 40
    with pytest.raises(ValueError, match="one image per document"):
        make_workload(2, n_docs=3, doc_tokens=50, sessions=1, turns=1, zipf_alpha=1.0, seed=1, images=images)


def test_ratios_compare_each_case_with_its_own_baseline() -> None:
    rows = [{"case": c, "users": 4, "ttft_p50_s": t, "ttft_p90_s": t, "out_tok_per_s": tput}
            for c, t, tput in (("vllm", 2.0, 10.0), ("memory", 1.0, 20.0), ("mm-vllm", 4.0, 5.0),
                               ("mm-kv-ec", 1.0, 10.0))]
    add_ratios(rows, {"mm-vllm": "mm-vllm", "mm-kv-ec": "mm-vllm"})
    assert [r["ttft_p50_ratio"] for r in rows] == [1.0, 0.5, 1.0, 0.25]
    assert [r["throughput_ratio"] for r in rows] == [1.0, 2.0, 1.0, 2.0]


def test_budget_rounds_to_blocks_and_respects_the_minimum() -> None:
    assert kv_budget_tokens(4000, 4.0, 100, 32) == 992  # floor(1000 / 32) blocks: the ratio stays >= 4
    assert kv_budget_tokens(4000, 4.0, 1500, 32) == 1504  # one max_model_len request must fit


@pytest.mark.engine
@pytest.mark.timeout(1260)
def test_bench_serve_quick_text_cases_end_to_end(tmp_path: Path) -> None:
    cases = ("vllm", "memory", "memory-disk")
    out, report = run_quick(tmp_path, cases, extra_args=("--events",))
    assert "vllm x1 users:" in out and "memory-disk x4 users:" in out
    rows = rows_checked(report, "text", cases, baseline="vllm")
    # with 4 users the working set no longer fits vLLM's cache and the connector loads what it evicted
    for case in ("memory", "memory-disk"):
        assert rows[(case, 4)]["kv_hit"] > 0, case
        assert rows[(case, 4)]["kv_loaded_tokens"] > 0, case
    # --events: Dynamo's indexer, asked before each of the run's distinct prompts is resent, promised only
    # what the resend then reused (the connector's tiers included), and showed all of it
    assert "KV events audit" in out
    assert set(report["events_audit"]) == {"memory", "memory-disk"}
    for case, audit in report["events_audit"].items():
        assert audit["prompts"] == 32, (case, audit)  # 2 levels x 8 sessions x 2 turns, all distinct
        assert audit["tier_promised_blocks"] > 0, (case, audit)  # the tiers' events, not only vLLM's GPU ones
        assert audit["over_promised_blocks"] == 0, (case, audit)
        assert audit["under_announced_blocks"] == 0, (case, audit)
