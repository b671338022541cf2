"""The Redis tier's parts alone, without a server: the record codec, the failure log, the health state
machine and its prober, the calls' failure handling and the cluster router's routing before the network.

The tier's behaviour against real servers is tested in test_store_redis.py and test_redis_cluster.py.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch

from tests.support.waiting import wait_until
from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.redis.calls import RedisCalls
from vllm_tiercache.shared.store.tiers.redis.cluster import ClusterRouter
from vllm_tiercache.shared.store.tiers.redis.config import RedisTierConfig
from vllm_tiercache.shared.store.tiers.redis.errors import TIER_LOGGER_NAME, FailureLog, ShardDownError
from vllm_tiercache.shared.store.tiers.redis.health import MIN_PROBE_INTERVAL_S, SLOT_MAP_REFRESH_S, TierHealth
from vllm_tiercache.shared.store.tiers.redis.records import (
    MissingPiece,
    MultiPart,
    RecordNames,
    decode_first,
    decode_rest,
    head_part_count,
    head_record_size,
    head_value,
    part_count,
    payload_parts,
)

KEY = StoreKey("redis-parts|kv|m|f|tp1r0|abc|L0")


def _encoded(n: int, key: StoreKey = KEY) -> records.Encoded:
    return records.encode(key, torch.arange(n, dtype=torch.int32), {"m": 1})


def _stored(enc: records.Encoded, part_size: int) -> tuple[bytes, list[bytes]]:
    """The head and parts as Redis would hand them back (bytes)."""
    parts = payload_parts(enc.payload, part_size)
    return head_value(len(parts), enc.prefix), [bytes(p) for p in parts]


# ------------------------------------------------------------------------------------------- codec
def test_names_are_digests_under_the_prefix() -> None:
    names = RecordNames("p:")
    head = names.head(KEY)
    assert head == f"p:{{{KEY.hex}}}" == names.head_of(KEY.hex)
    assert names.part(KEY, 3) == names.part_of(head, 3) == f"{head}:3"
    assert names.text(KEY) == names.text_of(head) == f"{head}#text"
    assert names.digest_of(head) == KEY.hex
    assert names.is_head(head) and not names.is_head(names.part(KEY, 0)) and not names.is_head(names.text(KEY))
    assert names.scan_pattern == "p:{*}"


@pytest.mark.parametrize(("nbytes", "part_size", "parts"), [(0, 1024, 1), (1, 1024, 1), (1024, 1024, 1),
                                                            (1025, 1024, 2), (4096, 1024, 4)])
def test_part_count(nbytes: int, part_size: int, parts: int) -> None:
    assert part_count(nbytes, part_size) == parts


def test_parts_are_views_of_the_payload_not_copies() -> None:
    enc = _encoded(1000)  # 4000 bytes
    parts = payload_parts(enc.payload, 1024)
    assert [p.nbytes for p in parts] == [1024, 1024, 1024, 928]
    assert all(p.obj is enc.payload.obj for p in parts)
    assert b"".join(bytes(p) for p in parts) == bytes(enc.payload)


def test_one_part_round_trip() -> None:
    enc = _encoded(100)
    head, parts = _stored(enc, 1 << 20)
    assert head_part_count(head) == 1 and head_record_size(head) == enc.nbytes
    record = decode_first(head, parts[0], KEY)
    assert not isinstance(record, MultiPart)
    assert torch.equal(record.tensor, torch.arange(100, dtype=torch.int32)) and record.meta == {"m": 1}


def test_many_parts_round_trip() -> None:
    enc = _encoded(1000)
    head, parts = _stored(enc, 1024)
    first = decode_first(head, parts[0], KEY)
    assert isinstance(first, MultiPart) and first.nparts == 4 == head_part_count(head)
    record = decode_rest(first, parts[1:], KEY)
    assert torch.equal(record.tensor, torch.arange(1000, dtype=torch.int32))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


@pytest.mark.parametrize("damage", [
    lambda head, p0: (head[:2], p0),  # shorter than its part count
    lambda head, p0: (head, None),  # first part gone
    lambda head, p0: (head[:4] + b"XXXX" + head[8:], p0),  # bad magic
    lambda head, p0: (_flip(head, 30), p0),  # header checksum
    lambda head, p0: (head, _flip(p0, 0)),  # payload checksum
    lambda head, p0: (head, p0[:-4]),  # truncated payload
    lambda head, p0: (struct.pack("<I", 0) + head[4:], p0),  # part count 0
    lambda head, p0: (struct.pack("<I", 10_000) + head[4:], p0),  # more parts than its size allows
    # one part more than the first part's length makes of the size: damage, not a part evicted
    lambda head, p0: (struct.pack("<I", 2) + head[4:], p0),
], ids=["short-head", "no-part0", "magic", "header-sum", "payload-sum", "truncated", "zero-parts", "many-parts",
        "one-part-more"])
def test_damaged_first_round_trip_is_a_record_error(damage: Callable[[bytes, bytes], tuple[bytes, Any]]) -> None:
    head, parts = _stored(_encoded(100), 1 << 20)
    bad_head, bad_part0 = damage(head, parts[0])
    with pytest.raises(records.RecordError) as raised:
        decode_first(bad_head, bad_part0, KEY)
    # a piece gone (Redis evicted or expired it) is told apart from damage: counted partial, not corrupt
    assert isinstance(raised.value, MissingPiece) == (bad_part0 is None)


def test_another_records_head_is_a_record_error() -> None:
    head, parts = _stored(_encoded(100, StoreKey("another")), 1 << 20)
    with pytest.raises(records.RecordError, match="key mismatch"):
        decode_first(head, parts[0], KEY)


def test_another_formats_record_is_other_format_not_damage() -> None:
    head, parts = _stored(_encoded(100), 1 << 20)
    other = head[:8] + struct.pack("<H", records.VERSION + 1) + head[10:]  # u32 part count, magic, version
    with pytest.raises(records.OtherFormatError):
        decode_first(other, parts[0], KEY)


@pytest.mark.parametrize("damage", [
    lambda rest: [rest[0], None, rest[2]],  # a part expired
    lambda rest: [rest[0], rest[1][:-1], rest[2]],  # parts one byte short
    lambda rest: [rest[0], rest[1] + b"x", rest[2]],  # one byte too many
    lambda rest: [rest[0], _flip(rest[1], 5), rest[2]],  # a flipped payload byte
], ids=["missing", "short", "long", "flipped"])
def test_damaged_parts_are_a_record_error(damage: Callable[[list[bytes]], list[Any]]) -> None:
    head, parts = _stored(_encoded(1000), 1024)
    first = decode_first(head, parts[0], KEY)
    assert isinstance(first, MultiPart)
    rest = damage(parts[1:])
    with pytest.raises(records.RecordError) as raised:
        decode_rest(first, rest, KEY)
    assert isinstance(raised.value, MissingPiece) == (None in rest)


def test_unreadable_heads_have_no_size() -> None:
    assert head_record_size(b"") is None and head_record_size(b"\x01\x00\x00\x00garbage") is None
    assert head_part_count(b"\x01") == 0


# -------------------------------------------------------------------------------------- failure log
def _failure_log(closed: bool = False) -> tuple[FailureLog, TierCounters, list[BaseException]]:
    counters, downs = TierCounters(), []
    return FailureLog("redis://x", counters, is_closed=lambda: closed, mark_down=downs.append), counters, downs


def test_failures_are_counted_each_time_and_logged_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    failures, counters, downs = _failure_log()
    with caplog.at_level(logging.DEBUG, logger=TIER_LOGGER_NAME):
        for _ in range(3):
            failures.failed("put", redis.ResponseError("OOM"))
            failures.failed("get", AttributeError("boom"))
        failures.failed("get", redis.ConnectionError("refused"))
    assert counters.get("errors") == 6 and len(downs) == 1  # a down failure is counted by the health
    assert [(r.levelno, r.exc_info is not None) for r in caplog.records] == [(logging.WARNING, False),
                                                                             (logging.ERROR, True)]


def test_a_bug_after_close_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    failures, counters, _ = _failure_log(closed=True)
    with caplog.at_level(logging.DEBUG, logger=TIER_LOGGER_NAME):
        failures.bug("get", AttributeError("no client"))
    assert counters.get("errors") == 1 and [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_a_stale_map_is_one_info_line_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    failures, counters, _ = _failure_log()
    with caplog.at_level(logging.DEBUG, logger=TIER_LOGGER_NAME):
        for _ in range(3):
            failures.stale_map("get", redis.exceptions.MovedError("1 127.0.0.1:7001"), 1.0)
    assert counters.get("errors") == 0 and [r.levelno for r in caplog.records] == [logging.INFO]


# ------------------------------------------------------------------------------------------ health
class _Probe:
    """A probe whose answer the test sets; counts its calls and their threads."""

    def __init__(self, answer: bool = False) -> None:
        self.answer = answer
        self.threads: list[int] = []
        self.called = threading.Event()

    def __call__(self) -> bool:
        self.threads.append(threading.get_ident())
        self.called.set()
        return self.answer


def _health(probe: _Probe, *, cluster: bool = False, retry_after_s: float = 0.0) -> TierHealth:
    return TierHealth("redis://x", retry_after_s, TierCounters(), cluster=cluster, attempt="single server",
                      probe=probe, thread_name="tiercache-probe-test")


def test_down_then_the_prober_alone_brings_it_back(caplog: pytest.LogCaptureFixture) -> None:
    probe = _Probe(answer=False)
    health = _health(probe)
    with caplog.at_level(logging.WARNING, logger=TIER_LOGGER_NAME):
        health.mark_down(redis.ConnectionError("refused"))
        health.mark_down(redis.ConnectionError("refused"))  # already down: counted, not logged again
        assert health.down and health.up_share(lambda: 3) == 0.0 and health.counters.get("errors") == 2
        assert probe.called.wait(30)
        assert health.down  # the probe failed
        probe.answer = True
        # the prober marks it up, then logs its line after the lock: wait for the line, not only the state
        wait_until("the prober's 'reachable again'", lambda: not health.down and any(
            "reachable again" in r.getMessage() for r in caplog.records), limit_s=30.0, poll_s=0.005)
    assert threading.get_ident() not in probe.threads
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "unreachable" in lines[0] and "tried: single server" in lines[0]
    assert lines[1] == "tiercache redis tier: redis://x reachable again"
    health.close()


def test_a_call_that_succeeds_marks_it_up_once(caplog: pytest.LogCaptureFixture) -> None:
    health = _health(_Probe(), retry_after_s=60)
    with caplog.at_level(logging.WARNING, logger=TIER_LOGGER_NAME):
        health.mark_up()  # up already: nothing
        health.mark_down(OSError("reset"))
        health.mark_up()
        health.mark_up()
    assert not health.down and [r.getMessage().endswith("reachable again") for r in caplog.records] == [False, True]
    health.close()


def test_a_closed_tier_starts_no_prober() -> None:
    probe = _Probe()
    health = _health(probe)
    health.close()
    health.mark_down(redis.ConnectionError("refused"))
    time.sleep(0.05)
    assert health.down and not probe.threads


def test_shards_down_then_the_whole_cluster(caplog: pytest.LogCaptureFixture) -> None:
    health = _health(_Probe(), cluster=True, retry_after_s=60)
    primaries = {"a:1", "b:2", "c:3"}
    with caplog.at_level(logging.WARNING, logger=TIER_LOGGER_NAME):
        health.shards_failed({"b:2": (5, redis.ConnectionError("refused"))}, primaries)
        health.shards_failed({"b:2": (5, redis.ConnectionError("refused"))}, primaries)  # known: no line
        assert health.shards_down == ["b:2"] and not health.down
        assert health.up_share(lambda: 3) == pytest.approx(2 / 3) and health.up_share(lambda: 0) == 0.5
        assert health.probe_interval() == SLOT_MAP_REFRESH_S
        health.shards_failed({"a:1": (1, OSError("reset")), "c:3": (9, OSError("reset"))}, primaries)
    assert health.down and health.shards_down == ["a:1", "b:2", "c:3"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "shard b:2 unreachable" in lines[0] and "2 other shard(s)" in lines[0]
    assert "tried: single server" in lines[1]  # the whole tier's line, not a shard's
    health.close()


def test_shards_come_back_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    health = _health(_Probe(), cluster=True, retry_after_s=60)
    health.shards_failed({"a:1": (1, OSError()), "b:2": (5, OSError())}, {"a:1", "b:2", "c:3"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=TIER_LOGGER_NAME):
        health.cluster_up({"a:1": "a:1", "b:2": "d:4"})
    assert health.shards_down == [] and health.up_share(lambda: 3) == 1.0
    lines = [r.getMessage() for r in caplog.records]
    assert "shard a:1 reachable again" in lines[0] and "shard b:2 failed over to d:4" in lines[1]
    health.close()


def test_a_refresh_taken_by_a_failed_probe_is_kept() -> None:
    health = _health(_Probe(), cluster=True, retry_after_s=60)
    assert health.probe_interval() == 60
    health.ask_refresh()
    assert health.needs_probe() and health.probe_interval() == SLOT_MAP_REFRESH_S
    whole, shards, refresh = health.take_probe_work()
    assert (whole, shards, refresh) == (False, {}, True) and not health.refresh_asked
    health.keep_refresh(refresh)
    assert health.refresh_asked
    health.close()
    assert _health(_Probe(), retry_after_s=0).probe_interval() == MIN_PROBE_INTERVAL_S


# ------------------------------------------------------------------------------------------- calls
class _Pipeline:
    def __init__(self, results: list[Any]) -> None:
        self.results = results
        self.queued = 0

    def get(self, name: str) -> None:
        self.queued += 1

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        return self.results[:self.queued]


class _Client:
    """A standalone client whose pipelines answer what the test says."""

    def __init__(self, results: list[Any]) -> None:
        self.results = results

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self.results)

    def close(self) -> None:
        pass


def _calls(results: list[Any]) -> RedisCalls:
    config = RedisTierConfig(url="redis://127.0.0.1:1/0", retry_after_s=60)
    health = TierHealth(config.address, 60, TierCounters(), cluster=False, attempt="", probe=lambda: False,
                        thread_name="tiercache-probe-test")
    calls = RedisCalls(config, health, health.counters)
    calls.client = _Client(results)
    return calls


def _queue_gets(n: int) -> Callable[[Any], None]:
    def queue(pipe: Any) -> None:
        for i in range(n):
            pipe.get(f"k{i}")
    return queue


def test_a_batch_with_some_failed_commands_is_served_and_counted_once() -> None:
    calls = _calls([b"a", redis.ResponseError("OOM"), redis.ResponseError("OOM"), b"d"])
    res = calls.pipeline("get", _queue_gets(4))
    assert res is not None and res[0] == b"a" and isinstance(res[1], redis.ResponseError) and res[3] == b"d"
    assert not calls.health.down and calls.health.counters.get("errors") == 1
    calls.close()


def test_a_batch_whose_every_command_found_the_server_gone_marks_it_down() -> None:
    calls = _calls([redis.ConnectionError("reset")] * 3)
    assert calls.pipeline("get", _queue_gets(3)) is None
    assert calls.health.down
    ran: list[int] = []
    assert calls.run("info", lambda: ran.append(1)) is None and not ran  # down: no call reaches the network
    calls.close()


def test_a_call_that_raises_is_a_none_never_an_exception() -> None:
    calls = _calls([])

    def boom() -> None:
        raise redis.ResponseError("WRONGTYPE")

    assert calls.run("get", boom) is None and not calls.health.down
    assert calls.run("get", lambda: 7) == 7
    calls.close()


# ------------------------------------------------------------------------------------------ router
class _Node:
    def __init__(self, name: str) -> None:
        self.name = name


class _ClusterClient:
    """A slot map of two slots, one served by ``a:1``; slot 1 by nobody. No connection is ever made."""

    def __init__(self) -> None:
        self.nodes_manager = type("Nodes", (), {"slots_cache": {0: [_Node("a:1")]}})()

    @staticmethod
    def keyslot(key: Any) -> int:
        return 0 if str(key).startswith("a") else 1

    def get_redis_connection(self, node: _Node) -> Any:
        raise AssertionError("a shard marked down or an uncovered slot must not be sent to")


def test_the_router_answers_down_shards_and_uncovered_slots_without_the_network() -> None:
    router = ClusterRouter("redis+cluster://x", 60)
    errors: list[Exception] = []
    failed: dict[str, tuple[int, BaseException]] = {}

    def queue(pipe: Any) -> None:
        pipe.get("a-key")
        pipe.get("b-key")
        pipe.get("a-other")

    res = router.send(_ClusterClient(), queue, {"a:1"}, errors, failed)
    assert isinstance(res[0], ShardDownError) and res[2] is res[0]
    assert isinstance(res[1], redis.exceptions.SlotNotCoveredError) and errors == [res[1]] and not failed
