"""`tiercache bench serve --quick` end to end on the multimodal cases: BLIP-2, the KV and encoder connectors.

Its own module so that it starts on another worker than the text cases (test_bench_serve.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools.bench.serve.run import rows_checked, run_quick


@pytest.mark.engine
@pytest.mark.timeout(1260)
def test_bench_serve_quick_multimodal_cases_end_to_end(tmp_path: Path) -> None:
    cases = ("mm-vllm", "mm-kv-ec")
    out, report = run_quick(tmp_path, cases)
    assert "mm-vllm x1 users:" in out and "mm-kv-ec x4 users:" in out
    rows = rows_checked(report, "multimodal", cases, baseline="mm-vllm")
    # the encoder connector saved the page images and was asked for them, and the KV connector loaded
    # evicted prefixes. (Its hits are not asserted: on this small trace KV hits and vLLM's own encoder
    # cache cover the repeats first; test_ec_connector proves hits beside the KV connector.)
    mm = rows[("mm-kv-ec", 4)]
    assert mm["ec_saves"] > 0 and mm["ec_lookups"] > 0, mm
    assert mm["kv_loaded_tokens"] > 0, mm
