"""Pins: `tiercache pin --tag` keeps a corpus through eviction on every tier, within each tier's pin_budget,
on real files and a real redis-server.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.waiting import wait_until
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.control import Control
from vllm_tiercache.tools.cli import main as cli_main
from vllm_tiercache.tools.pin_cmd import pin, read_pins, unpin
from vllm_tiercache.tools.redis_server import RedisServer

#: one record: 4 KiB of payload (plus its header on disk)
PAYLOAD = 1024


def _keys(prefix: str, n: int) -> list[StoreKey]:
    return [StoreKey(f"a|kv|m1|f|tp1r0|{prefix}{i}|L0") for i in range(n)]


CORPUS = _keys("corpus", 8)


def _corpus_items() -> list:
    return [(k, torch.full((PAYLOAD,), 1.0), {"tags": ["corpus:v3"]}) for k in CORPUS]


def _disk(tmp_path: Path, capacity: str = "80KiB", budget: float = 0.5) -> dict:
    return {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": capacity, "pin_budget": budget}


@contextmanager
def store_with_a_pinned_corpus(redis_url: str) -> Iterator[tuple[Any, Any, Any]]:
    """(store, memory tier, Redis tier): a 64 KiB memory tier before Redis at ``redis_url``, whose control
    entries alone hold the pin ``corpus:v3``; the corpus is stored and the memory tier has read the pin."""
    config = {"control_poll_s": 0.02, "tiers": [
        {"kind": "memory", "capacity": "64KiB", "pin_budget": 0.6},
        {"kind": "redis", "url": redis_url, "pin_budget": 0.5, "timeout_s": 0.3, "retry_after_s": 0.05}]}
    pin(config, ["corpus:v3"])
    with build_store(config) as store:
        memory, redis_tier = store.tiers
        store.put_many(_corpus_items())
        assert store.flush(30.0)
        _wait_for_polls(store, 1)
        assert memory._pins == frozenset({"corpus:v3"})
        yield store, memory, redis_tier


def assert_the_pin_holds_while_redis_cannot_answer(store: Any, memory: Any, redis_tier: Any) -> None:
    """Polls that could not read Redis keep its last read: the pin holds, and one-off traffic 12x the memory
    tier (its Redis copies wait or are skipped) cannot evict the pinned corpus."""
    _wait_for_polls(store, 2)  # at least one whole poll that could not read Redis
    assert redis_tier.name in store.control._warned  # it did try, and failed
    assert memory._pins == frozenset({"corpus:v3"})
    one_offs = _keys("oneoff", 100)
    for lo in range(0, len(one_offs), 10):
        store.put_many([(k, torch.zeros(PAYLOAD), None) for k in one_offs[lo:lo + 10]])
    assert memory.contains_many(CORPUS) == [True] * len(CORPUS)
    assert memory.counters.get("evictions") > 50  # the pressure was real


def _wait_for_polls(store, n: int = 2) -> None:
    """Until ``n`` polls began after this call (the pins read after what the caller wrote)."""
    start = store.control.polls
    wait_until(f"{n} polls", lambda: store.control.polls >= start + n, poll_s=0.01)


@pytest.mark.parametrize(("budget", "message"), [
    (0.0, r"pin refused: pins are off on tier disk \(tiers\[0\]\.pin_budget is 0\); set tiers\[0\]\.pin_budget"),
    (0.1, r"pin refused: tier disk would hold \d{2},\d{3} bytes .* of pinned records \(tags corpus:v3\), above its "
          r"pin budget of 8,192 bytes \(tiers\[0\]\.pin_budget 0\.1 of its capacity 80\.0 KiB\)"),
])
def test_a_pin_beyond_the_budget_is_refused_naming_it(tmp_path: Path, budget: float, message: str) -> None:
    config = {"tiers": [_disk(tmp_path, budget=budget)]}
    with build_store(config) as store:
        store.put_many(_corpus_items())
    with pytest.raises(ValueError, match=message):
        pin(config, ["corpus:v3"])
    with build_store(config) as store:
        assert read_pins(store.tiers).pins == {}  # nothing written


@pytest.mark.parametrize("policy", ["lru", "wtinylfu"])
def test_eviction_never_drops_pinned_records_on_disk_and_in_memory(tmp_path: Path, policy: str) -> None:
    config = {"control_poll_s": 0.02, "tiers": [{"kind": "memory", "capacity": "64KiB", "pin_budget": 0.6,
                                                 "policy": policy}, _disk(tmp_path)]}
    with build_store(config) as store:
        store.put_many(_corpus_items())
        assert store.flush(30.0)
        result = pin(config, ["corpus:v3"])
        assert result["tiers"][1]["pinned_bytes"] > 8 * PAYLOAD * 4 and result["tiers"][0]["note"]
        _wait_for_polls(store)
        one_offs = _keys("oneoff", 200)  # 10x the disk tier, 25x the memory tier
        for lo in range(0, len(one_offs), 10):
            store.put_many([(k, torch.zeros(PAYLOAD), None) for k in one_offs[lo:lo + 10]])
            assert store.flush(30.0)
        memory, disk = store.tiers
        assert memory.contains_many(CORPUS) == [True] * len(CORPUS)
        assert disk.contains_many(CORPUS) == [True] * len(CORPUS)
        assert sum(disk.contains_many(one_offs)) < 20 and sum(memory.contains_many(one_offs)) < 10
        # the pressure was real: one-offs evicted (lru) or refused by admission (wtinylfu)
        assert memory.counters.get("evictions") + memory.counters.get("refused") > 100
        assert disk.counters.get("evictions") > 100
    unpin(config, ["corpus:v3"])
    with build_store(config) as store:  # unpinned: the corpus is evicted like any record
        more = _keys("more", 120)  # 6x the disk: records never seen before go first for ~3 half-lives (prefix)
        for lo in range(0, len(more), 10):
            store.put_many([(k, torch.zeros(PAYLOAD), None) for k in more[lo:lo + 10]])
            assert store.flush(30.0)
        assert store.tiers[1].contains_many(CORPUS) == [False] * len(CORPUS)


def test_pins_survive_a_restart_and_reach_a_new_stores_memory_tier(tmp_path: Path, redis_url: str) -> None:
    config = {"control_poll_s": 0.02, "tiers": [{"kind": "memory", "capacity": "1MiB", "pin_budget": 0.5},
                                                _disk(tmp_path), {"kind": "redis", "url": redis_url,
                                                                  "pin_budget": 0.5}]}
    pin(config, ["corpus:v3"], ttl_s=3600.0)
    with build_store(config) as store:
        _wait_for_polls(store, 1)
        assert store.tiers[0]._pins == frozenset({"corpus:v3"})
        for tier in store.tiers[1:]:
            pins = read_pins([tier]).pins
            assert list(pins) == ["corpus:v3"] and pins["corpus:v3"] > time.time() + 3000


def test_redis_pinned_records_have_no_ttl_until_unpinned(tmp_path: Path, redis_url: str) -> None:
    config = {"control_poll_s": 0.02, "tiers": [{"kind": "redis", "url": redis_url, "ttl_s": 600,
                                                 "pin_budget": 0.5, "part_size": "1KiB"}]}
    with build_store(config) as store:
        store.put_many(_corpus_items())
        plain = _keys("plain", 2)
        store.put_many([(k, torch.zeros(16), None) for k in plain])
        assert store.flush(30.0)
        tier = store.tiers[0]
        client = tier._calls.client_or_raise()
        names = tier._names

        def ttls(keys: list[StoreKey]) -> set[int]:
            pieces = [n for k in keys for n in (names.head(k), names.text(k), names.part(k, 0))]
            pieces += [n for k in keys if k not in plain for n in (names.tags(k), names.part(k, 3))]  # 4 KiB: 4 parts
            return {client.ttl(n) for n in pieces}

        assert all(0 < t <= 600 for t in ttls(CORPUS))
        assert pin(config, ["corpus:v3"])["tiers"][0]["persisted"] == len(CORPUS)
        assert ttls(CORPUS) == {-1}
        assert all(t > 0 for t in ttls(plain))
        _wait_for_polls(store)  # a record of the pinned tag written now gets no TTL either
        late = _keys("late", 1)
        store.put_many([(late[0], torch.full((PAYLOAD,), 2.0), {"tags": ["corpus:v3"]})])
        assert store.flush(30.0)
        assert ttls(late) == {-1}
        assert unpin(config, ["corpus:v3"])["tiers"][0]["expiring"] == len(CORPUS) + 1
        assert all(0 < t <= 600 for t in ttls([*CORPUS, *late]))


@pytest.mark.serial
def test_a_pin_with_a_ttl_ends_and_redis_records_get_their_ttl_back(tmp_path: Path, redis_url: str) -> None:
    """The pin lasts 0.5 s. While it is set and checked, no store polls (each has polled once, at its start),
    so nothing can claim it before the check, however long `pin` takes on a loaded machine; then a serving
    store's polls claim it once it ended."""
    tiers = [{"kind": "redis", "url": redis_url, "ttl_s": 600, "pin_budget": 0.5}]
    quiet = {"control_poll_s": 3600.0, "tiers": tiers}
    with build_store(quiet) as store:
        store.put_many(_corpus_items())
        assert store.flush(30.0)
        wait_until("the store's one poll", lambda: store.control.polls >= 1, poll_s=0.01)
        tier = store.tiers[0]
        client = tier._calls.client_or_raise()
        pin(quiet, ["corpus:v3"], ttl_s=0.5)
        assert all(client.ttl(tier._names.head(k)) == -1 for k in CORPUS)
        until = read_pins([tier]).pins["corpus:v3"]
        while time.time() <= until:
            time.sleep(0.05)
        assert read_pins([tier]).pins == {"corpus:v3": until}  # ended, not claimed yet
        with build_store({"control_poll_s": 0.02, "tiers": tiers}) as serving:
            _wait_for_polls(serving)  # a poll after the pin's end claims it and gives the TTL back
            assert read_pins([tier]).pins == {}
            assert all(0 < client.ttl(tier._names.head(k)) <= 600 for k in CORPUS)
            assert serving.control.poll().pinned_now() == frozenset()


@pytest.mark.redis
def test_a_pin_that_ends_while_it_is_written_leaves_every_record_its_ttl(redis_url: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``--ttl`` shorter than `pin` takes: a serving process's poll claims the ended pin between its entry
    and the PERSIST of its records, and gives the TTL back first. The records persisted after that must
    get it back too (they kept none for good)."""
    from vllm_tiercache.shared.store import RedisTier

    config = {"tiers": [{"kind": "redis", "url": redis_url, "ttl_s": 600, "pin_budget": 0.5}]}
    with build_store(config) as store:
        store.put_many(_corpus_items())
        assert store.flush(30.0)
        tier = store.tiers[0]
        client = tier._calls.client_or_raise()
        real = RedisTier.write_control
        claims = []

        def then_claimed(self: Any, changes: Any) -> None:
            real(self, changes)
            until = read_pins([self]).pins.get("corpus:v3")
            if until is not None:  # the pin's entry is written: it ends, and a poll claims it
                while time.time() <= until:
                    time.sleep(0.005)
                store.control.poll()
                claims.append(read_pins([self]).pins)

        monkeypatch.setattr(RedisTier, "write_control", then_claimed)
        pin(config, ["corpus:v3"], ttl_s=0.01)
        assert claims == [{}]  # claimed before the records were persisted
        assert read_pins([tier]).pins == {}
        assert all(0 < client.ttl(tier._names.head(k)) <= 600 for k in CORPUS)


def test_control_pins_end_when_their_time_is_past() -> None:
    control = Control(pins={"a": None, "b": 100.0, "c": 300.0})
    assert control.pinned_now(now=200.0) == frozenset({"a", "c"})
    assert control.expired_pins(now=200.0) == ["b"]


@pytest.mark.parametrize(("argv", "message"), [
    (["pin", "--tag", "x", "--ttl", "0"], "invalid value '0'; allowed: a number of seconds above 0"),
    (["pin", "--tag", "x", "--ttl", "soon"], "invalid value 'soon'"),
    (["pin", "--tag", "x", "--ttl", "1e9"], "at most 3.16224e+07"),
    (["pin", "--tag", "a\nb"], "invalid tag 'a\\nb'"),
    (["pin"], "the following arguments are required: --tag"),
    (["unpin", "--tag", ""], "invalid tag ''"),
])
def test_pin_and_unpin_refuse_bad_arguments_in_one_line(tmp_path: Path, argv: list[str], message: str,
                                                         capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main([*argv, "--config", json.dumps({"tiers": [_disk(tmp_path)]})])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_pin_cli_refuses_with_the_budget_key_and_pins_when_set(tmp_path: Path, capsys) -> None:
    off = json.dumps({"tiers": [{"kind": "memory", "capacity": "1MiB"}, _disk(tmp_path)]})
    assert cli_main(["pin", "--config", off, "--tag", "corpus:v3"]) == 2
    assert "tiers[0].pin_budget is 0" in capsys.readouterr().err
    on = json.dumps({"tiers": [{"kind": "memory", "capacity": "1MiB", "pin_budget": 0.2}, _disk(tmp_path)]})
    assert cli_main(["pin", "--config", on, "--tag", "corpus:v3", "--ttl", "60"]) == 0
    assert "pinned corpus:v3 for 60 s" in capsys.readouterr().out
    assert cli_main(["unpin", "--config", on, "--tag", "corpus:v3", "--tag", "other"]) == 0
    assert "unpinned corpus:v3, other (not pinned before: other)" in capsys.readouterr().out


@pytest.mark.redis
def test_a_pin_read_from_redis_holds_in_memory_while_redis_hangs(tmp_path: Path) -> None:
    """The pin lives only in Redis's control entries; Redis then stops answering (SIGSTOP). The polls that
    cannot read it keep counting its last good read, so one-off traffic meanwhile still cannot evict the
    pinned corpus from the memory tier (a poll that forgot the pin would hand the corpus to the LRU)."""
    with RedisServer() as redis_srv, store_with_a_pinned_corpus(redis_srv.url) as (store, memory, redis_tier):
        redis_srv.pause()
        try:
            assert_the_pin_holds_while_redis_cannot_answer(store, memory, redis_tier)
        finally:
            redis_srv.resume()
        _wait_for_polls(store, 2)  # read again once it answers: the pin is still there
        assert memory._pins == frozenset({"corpus:v3"})


@pytest.mark.redis
def test_pin_and_unpin_against_a_hung_redis_say_which_tier_and_what_was_written(tmp_path: Path, capsys) -> None:
    """Redis stopped (SIGSTOP) behind a disk tier: `pin` is refused in one line naming the tier, with
    nothing written anywhere; `unpin` removes the disk's entry, reports Redis as FAILED and exits 1."""
    with RedisServer() as redis_srv:
        config = {"tiers": [_disk(tmp_path), {"kind": "redis", "url": redis_srv.url, "pin_budget": 0.5,
                                              "timeout_s": 0.3}]}
        store_json = tmp_path / "store.json"
        store_json.write_text(json.dumps(config))
        assert cli_main(["pin", "--config", str(store_json), "--tag", "corpus:v3"]) == 0
        capsys.readouterr()
        redis_srv.pause()
        try:
            assert cli_main(["pin", "--config", str(store_json), "--tag", "corpus:v4"]) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and "pin refused, nothing written: tier redis (tiers[1]) did not answer" in err
            assert cli_main(["unpin", "--config", str(store_json), "--tag", "corpus:v3"]) == 1
            out = capsys.readouterr().out
            assert "tier redis (redis): FAILED:" in out and "except on redis" in out
        finally:
            redis_srv.resume()
        with build_store(config) as store:
            disk, redis_tier = store.tiers
            assert read_pins([disk]).pins == {}  # the disk took the unpin; corpus:v4 was written nowhere
            assert list(read_pins([redis_tier]).pins) == ["corpus:v3"]  # the run again that it asks for
        assert cli_main(["unpin", "--config", str(store_json), "--tag", "corpus:v3"]) == 0


@pytest.mark.redis
def test_a_redis_pin_is_counted_against_its_maxmemory_and_an_allkeys_policy_is_warned_of(tmp_path: Path,
                                                                                       capsys) -> None:
    """Redis's pin budget is a share of its ``maxmemory`` (no tier capacity to read it from); a server
    that may evict any key gets a warning, since a PERSISTed record is then no safer than another."""
    with RedisServer() as redis_srv:
        admin = redis_srv.client()
        admin.config_set("maxmemory", str(8 * 2**20))
        admin.config_set("maxmemory-policy", "volatile-lru")
        tier = {"kind": "redis", "url": redis_srv.url, "pin_budget": 0.001}  # 8,388 bytes: below the corpus
        with build_store({"tiers": [tier]}) as store:
            assert store.tiers[0].usage()["capacity"] == 8 * 2**20
            store.put_many(_corpus_items())
            assert store.flush(30.0)
        store_json = tmp_path / "store.json"
        store_json.write_text(json.dumps({"tiers": [tier]}))
        assert cli_main(["pin", "--config", str(store_json), "--tag", "corpus:v3"]) == 2
        err = capsys.readouterr().err
        assert "above its pin budget of 8,388 bytes (tiers[0].pin_budget 0.001 of its capacity 8.0 MiB)" in err
        store_json.write_text(json.dumps({"tiers": [{**tier, "pin_budget": 0.5}]}))
        assert cli_main(["pin", "--config", str(store_json), "--tag", "corpus:v3"]) == 0
        out = capsys.readouterr().out
        counted = re.search(r"tier redis \(redis\): ([\d,]+) of 4,194,304 pinned bytes", out)
        assert counted and int(counted[1].replace(",", "")) >= 8 * PAYLOAD * 4 and "warning" not in out
        admin.config_set("maxmemory-policy", "allkeys-lru")
        assert cli_main(["pin", "--config", str(store_json), "--tag", "corpus:v3"]) == 0
        assert "warning: its maxmemory-policy is allkeys-lru" in capsys.readouterr().out
