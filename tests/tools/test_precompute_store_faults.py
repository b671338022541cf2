"""A precompute job rides out a store having a bad day in the middle of the job: SeaweedFS behind
`tests.support.faulty_proxy` hangs as the job's first record PUT reaches it, then refuses connections, then
answers 503 SlowDown, then serves again. The job (a real engine, through the CLI) stores every document,
fails none, and its report says how long it waited the store out, what it put again and how many throttling
answers it met. The fault durations are the fault itself, not waits of the test: every wait is for an event."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from tests.support.faulty_proxy import FaultyProxy
from tests.tools.test_precompute import LLAMA_ENGINE, _make_docs, _run_job

pytestmark = [pytest.mark.engine, pytest.mark.s3]

#: how long the store hangs, then refuses connections: each many times the tier's timeout
HANG_S, REFUSE_S = 5.0, 5.0
#: record PUTs the store answers 503 SlowDown before it serves again
THROTTLED_PUTS = 3
WAITS = re.compile(r"object: waited ([\d.]+) s, (\d+) records put again, (\d+) throttled answers, (\d+) given up")


def _bad_day(proxy: FaultyProxy, record_put: bytes, done: threading.Event) -> None:
    proxy.set_mode("hang")
    time.sleep(HANG_S)
    proxy.set_mode("refuse")
    time.sleep(REFUSE_S)
    proxy.set_mode("throttle")
    deadline = time.monotonic() + 300  # only a bound: the writer's backoff sends its next tries within seconds
    while sum(line.startswith(record_put) for line in proxy.throttled) < THROTTLED_PUTS and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    proxy.set_mode("forward")
    done.set()


def test_a_job_stores_every_document_through_a_hung_refusing_and_throttling_store(tiny_llama: Path, tmp_path: Path,
                                                                                  s3_bucket) -> None:
    docs = _make_docs(tmp_path / "docs")
    over = threading.Event()
    with FaultyProxy(s3_bucket.server.ports["s3"]) as proxy:
        record_put = f"PUT /{s3_bucket.bucket}/tiercache/r/".encode()
        proxy.on_request(record_put, lambda: threading.Thread(target=_bad_day, args=(proxy, record_put, over),
                                                              daemon=True).start())
        store = {"namespace": "patient-job", "chunk_size": 64,
                 "tiers": [s3_bucket.tier_config(endpoint=proxy.endpoint, timeout_s=1.0, retry_after_s=0.2)]}
        code, summary, err = _run_job("docs", "--model", str(tiny_llama), "--docs", str(tmp_path / "docs"),
                                      "--config", json.dumps(store), "--engine-args", json.dumps(LLAMA_ENGINE),
                                      "--batch-size", "1", "--store-patience", "300")
        assert over.is_set(), "the store's bad day had not ended when the job did"
    assert code == 0, err[-4000:]
    assert (summary["total"], summary["stored"], summary["failed"]) == (len(docs), len(docs), []), summary
    waits = WAITS.search(summary["details"].get("store_waits", ""))
    assert waits is not None, summary["details"]
    waited, put_again, throttled, given_up = float(waits[1]), int(waits[2]), int(waits[3]), int(waits[4])
    assert waited > 0 and put_again > 0 and throttled >= THROTTLED_PUTS and given_up == 0, summary["details"]

