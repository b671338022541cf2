"""The object tier's parts without a server: what each failure means, the health state machine and its
prober, record metadata, and the janitor's last-use rule."""

from __future__ import annotations

import logging
import threading

import botocore.exceptions
import pytest

from vllm_tiercache.shared.store import StoreKey
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tags import MAX_TAG_LENGTH, MAX_TAGS
from vllm_tiercache.shared.store.tiers.object.client import BUG, CONFLICT, DOWN, ERROR, MISSING, THROTTLED, classify
from vllm_tiercache.shared.store.tiers.object.health import ObjectHealth
from vllm_tiercache.shared.store.tiers.object.names import record_metadata, tags_in, text_of
from vllm_tiercache.shared.store.tiers.object.sweeps.evictions import last_use


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError({"Error": {"Code": code, "Message": "m"},
                                            "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize(("exc", "kind"), [
    (_client_error("NoSuchKey", 404), MISSING),
    (_client_error("404", 404), MISSING),
    (_client_error("PreconditionFailed", 412), CONFLICT),
    (_client_error("NoSuchBucket", 404), DOWN),
    (_client_error("AccessDenied", 403), DOWN),
    (_client_error("InvalidAccessKeyId", 403), DOWN),
    (_client_error("SignatureDoesNotMatch", 403), DOWN),
    (_client_error("InternalError", 500), ERROR),  # one request's answer: the store is up
    (_client_error("SlowDown", 503), THROTTLED),  # asks to slow down: back off, the store is up
    (_client_error("TooManyRequests", 429), THROTTLED),
    (_client_error("InvalidArgument", 400), ERROR),
    (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), DOWN),
    (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), DOWN),
    (botocore.exceptions.ConnectTimeoutError(endpoint_url="http://x"), DOWN),
    (botocore.exceptions.NoCredentialsError(), DOWN),
    (ConnectionResetError(), DOWN),
    (ValueError("ours"), BUG),
])
def test_classify(exc, kind):
    assert classify(exc) == kind


def test_health_goes_down_once_and_the_prober_brings_it_back(caplog):
    caplog.set_level(logging.WARNING)
    answers = [False, False, True]
    probed = threading.Event()
    threads: list[str] = []

    def probe() -> bool:
        threads.append(threading.current_thread().name)
        ok = answers.pop(0)
        if ok:
            probed.set()
        return ok

    health = ObjectHealth("http://e/b/p/", 0.01, TierCounters(), attempt=lambda: "tried this",
                          probe=probe, thread_name="tiercache-probe-test")
    exc = botocore.exceptions.EndpointConnectionError(endpoint_url="http://e")
    assert health.failed("get", exc) == DOWN and health.down
    health.failed("get", exc)  # a second failure while down: no second line
    assert probed.wait(30)
    for _ in range(1000):  # the prober marks the tier up under its lock, then logs the line outside it
        if not health.down and "reachable again" in caplog.text:
            break
        threading.Event().wait(0.01)
    assert not health.down and set(threads) == {"tiercache-probe-test"}
    assert caplog.text.count("unreachable during get") == 1 and "tried this" in caplog.text
    assert "reachable again" in caplog.text
    health.close()


def test_missing_and_conflicts_are_answers_not_failures():
    counters = TierCounters()
    health = ObjectHealth("a", 1.0, counters, attempt=str, probe=lambda: True, thread_name="t")
    assert health.failed("get", _client_error("NoSuchKey", 404)) == MISSING
    assert health.failed("lock", _client_error("PreconditionFailed", 412)) == CONFLICT
    assert counters.get("errors") == 0 and not health.down
    assert health.failed("get", _client_error("InternalError", 500)) == ERROR and not health.down
    assert counters.get("errors") == 1


def test_record_metadata_round_trips_any_key_text_and_tags():
    key = StoreKey("ns|kv|模型 name|x\udcff|y")  # non-ASCII and a lone surrogate
    meta = record_metadata(key, ("doc:1", "corpus v3"))
    assert all(value.isascii() for value in meta.values())
    assert text_of(meta).startswith("ns|kv|模型 name|x") and tags_in(meta) == ("doc:1", "corpus v3")
    many = tuple(f"{i}" + "t" * 98 for i in range(MAX_TAGS))  # 1.6 KiB of tags: they fit, the long text gives way
    meta = record_metadata(StoreKey("k" * 4000), many)
    assert tags_in(meta) == many and text_of(meta) == ""
    assert sum(len(k) + len(v) for k, v in meta.items()) <= 2048  # AWS's limit on user metadata
    huge = tuple(f"{i}" + "t" * (MAX_TAG_LENGTH - 3) for i in range(MAX_TAGS))  # more than S3 keeps
    meta = record_metadata(StoreKey("short"), huge)
    assert tags_in(meta) == () and text_of(meta) == "short"


def test_last_use_is_the_ledger_unless_the_object_is_newer():
    assert last_use(100.0, 100.4) == 100.4  # the write the ledger recorded, exactly
    assert last_use(100.0, None) == 101.0  # no ledger entry: the end of its LastModified second
    assert last_use(200.0, 150.0) == 201.0  # rewritten after the ledger's entry
