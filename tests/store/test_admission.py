"""Admission to the slower tiers (`shared/store/admission.py`): real files, a real redis-server.

A ``seen`` tier takes a record only once it was asked for ``min_seen`` times (the put, then each hit);
until then the record lives in memory only, and the hit that admits it writes the memory copy down.
Exempt puts (``always_admit``, ``urgent``) reach every tier at once; counters say what was admitted and
refused per tier; a restart finds on disk exactly what was admitted.
"""

from __future__ import annotations

import time

import pytest
import torch

from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tags import TAGS_KEY


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|admission|{i}")


def _t(seed: int) -> torch.Tensor:
    return torch.randn(256, generator=torch.Generator().manual_seed(seed))


def _config(tmp_path, redis_url: str | None = None, *, disk: dict | None = None, redis: dict | None = None,
            mem: str = "4MiB") -> StoreConfig:
    tiers = [{"kind": "memory", "capacity": mem},
             {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB",
              "admission": disk or {"policy": "seen", "min_seen": 2}}]
    if redis_url:
        tiers.append({"kind": "redis", "url": redis_url, "admission": redis or {"policy": "seen", "min_seen": 2}})
    return StoreConfig.load({"tiers": tiers})


def _held(store, key: StoreKey) -> list[bool]:
    """Which tiers hold ``key``, asked of each tier directly (after the writer is flushed)."""
    assert store.flush(10)
    return [tier.contains_many([key])[0] for tier in store.tiers]


def _counter(store, tier: str, name: str) -> int:
    return store.stats()["tiers"][tier][name]


def test_first_put_stays_in_memory_and_the_second_use_writes_it_down(tmp_path, redis_url):
    with build_store(_config(tmp_path, redis_url)) as store:
        store.put(_k(1), _t(1))
        assert _held(store, _k(1)) == [True, False, False]
        assert _counter(store, "disk", "writes_refused") == 1 and _counter(store, "redis", "writes_refused") == 1
        assert store.contains_many([_k(1)], shared_only=True) == [False]  # a lookup is not a use
        assert _held(store, _k(1)) == [True, False, False]
        rec = store.get(_k(1))  # the second use: a memory hit admits it
        assert torch.equal(rec.tensor, _t(1))
        assert _held(store, _k(1)) == [True, True, True]
        assert store.contains_many([_k(1)], shared_only=True, bounded=False) == [True]
        for tier in ("disk", "redis"):
            assert _counter(store, tier, "writes_admitted") == 1 and _counter(store, tier, "writes_refused") == 1
        store.get(_k(1))  # already written down: no second write
        assert _held(store, _k(1)) == [True, True, True]
        assert _counter(store, "disk", "puts") == 1 and _counter(store, "disk", "writes_admitted") == 1


def test_each_tier_has_its_own_threshold(tmp_path, redis_url):
    cfg = _config(tmp_path, redis_url, disk={"policy": "seen", "min_seen": 2}, redis={"policy": "seen", "min_seen": 3})
    with build_store(cfg) as store:
        store.put(_k(1), _t(1))
        store.get(_k(1))
        assert _held(store, _k(1)) == [True, True, False]
        store.get(_k(1))
        assert _held(store, _k(1)) == [True, True, True]


def test_a_record_evicted_before_its_second_use_is_admitted_by_its_second_put(tmp_path):
    with build_store(_config(tmp_path, mem="4KiB")) as store:  # the memory tier holds 3 records of 1 KiB
        store.put(_k(1), _t(1))
        for i in range(2, 8):
            store.put(_k(i), _t(i))
        assert _held(store, _k(1)) == [False, False]  # evicted from memory, never written down
        store.put(_k(1), _t(1))  # asked again: a miss that stores it a second time
        assert _held(store, _k(1))[1] is True


@pytest.mark.parametrize("how", [{"always_admit": True}, {"urgent": True}])
def test_exempt_puts_reach_every_tier_at_once(tmp_path, redis_url, how):
    with build_store(_config(tmp_path, redis_url)) as store:
        store.put_many([(_k(1), _t(1), None)], **how)
        assert _held(store, _k(1)) == [True, True, True]
        assert _counter(store, "disk", "writes_admitted") == 1 and _counter(store, "disk", "writes_refused") == 0


def test_always_is_the_default_and_counts_admitted_writes(tmp_path, redis_url):
    cfg = StoreConfig.load({"tiers": [{"kind": "memory", "capacity": "4MiB"},
                                      {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"},
                                      {"kind": "redis", "url": redis_url}]})
    assert cfg.tiers[1].admission.policy == "always" and cfg.tiers[2].admission.policy == "always"
    with build_store(cfg) as store:
        store.put_many([(_k(i), _t(i), None) for i in range(3)])
        assert _held(store, _k(2)) == [True, True, True]
        assert _counter(store, "redis", "writes_admitted") == 3 and _counter(store, "redis", "writes_refused") == 0
        assert store.take_counter_deltas()["tiers"]["disk"]["writes_admitted"] == 3  # what reaches /metrics


def test_a_restart_hits_only_what_was_admitted(tmp_path):
    with build_store(_config(tmp_path)) as store:
        store.put(_k("used"), _t(1))
        store.put(_k("one-off"), _t(2))
        store.get(_k("used"))
        assert store.flush(10)
    with build_store(_config(tmp_path)) as restarted:  # a new process's store on the same directory
        assert restarted.get(_k("one-off")) is None
        assert torch.equal(restarted.get(_k("used")).tensor, _t(1))


@pytest.mark.parametrize(("admission", "message"), [
    ({"policy": "sometimes"}, "tiers[1].admission.policy: invalid value 'sometimes'; allowed: always, seen"),
    ({"policy": "seen", "min_seen": 1}, "tiers[1].admission.min_seen: invalid value 1; allowed: an int from 2 to 15"),
    ({"policy": "seen", "min_seen": 16}, "tiers[1].admission.min_seen: invalid value 16"),
    ({"min_sen": 2}, "tiers[1].admission.min_sen: unknown key of admission; did you mean 'min_seen'?"),
    ("seen", "tiers[1].admission: invalid value 'seen'; allowed: a mapping"),
    ({"policy": "seen", "reused_prompt_share": 1.5},
     "tiers[1].admission.reused_prompt_share: invalid value 1.5; allowed: a number above 0 and at most 1, or null"),
    ({"policy": "seen", "reused_prompt_share": 0}, "tiers[1].admission.reused_prompt_share: invalid value 0;"),
    ({"policy": "seen", "reused_prompt_share": "half"}, "tiers[1].admission.reused_prompt_share: invalid value 'half'"),
])
def test_a_bad_admission_names_the_key(tmp_path, admission, message):
    with pytest.raises(ConfigError) as err:
        StoreConfig.load({"tiers": [{"kind": "memory"},
                                    {"kind": "disk", "path": str(tmp_path), "admission": admission}]})
    assert message in str(err.value)


def test_a_precompute_producer_writes_through(tmp_path):
    """The producer engine of `tiercache precompute` stores a corpus for later: every tier admits its puts,
    a tier declared in a config_file too."""
    from vllm_tiercache.tools.jobs import write_through

    config_file = tmp_path / "store.json"
    config_file.write_text('{"tiers": [{"kind": "memory"}, {"kind": "disk", "path": "%s", '
                           '"admission": {"policy": "seen", "min_seen": 3}}]}' % (tmp_path / "disk"))
    produced = write_through({"config_file": str(config_file), "chunk_size": 64})
    assert produced["chunk_size"] == 64
    assert StoreConfig.load(produced).tiers[1].admission.policy == "always"
    assert write_through({"chunk_size": 64}) == {"chunk_size": 64}  # nothing to change: as it was


def test_an_exempt_put_of_a_record_held_in_memory_only_is_not_written_down_again(tmp_path):
    with build_store(_config(tmp_path)) as store:
        store.put(_k(1), _t(1))
        store.put(_k(1), _t(1), always_admit=True)  # e.g. pinned afterwards
        store.get(_k(1))
        assert _held(store, _k(1)) == [True, True]
        assert _counter(store, "disk", "puts") == 1


def test_the_start_up_line_says_what_a_tier_admits(tmp_path):
    from vllm_tiercache.shared.store import describe_tiers

    assert describe_tiers(_config(tmp_path)).endswith("prefix admits seen>=2 or reused>=0.5")
    only_seen = _config(tmp_path, disk={"policy": "seen", "min_seen": 3, "reused_prompt_share": None})
    assert describe_tiers(only_seen).endswith("prefix admits seen>=3")


@pytest.mark.parametrize(("share", "admitted"), [(0.75, [True, True, False]), (0.5, [True, True, False]),
                                                  (0.4, [True, False, False]), (None, [True, False, False]),
                                                  (0.95, [True, True, True])])
def test_a_put_from_a_request_that_reused_its_prompt_is_admitted_at_once(tmp_path, redis_url, share, admitted):
    """A turn that reused most of its prompt extends a prefix being asked again: each tier whose share it
    reaches takes its new chunks at once; a fresh prompt (or a put with no request) waits for min_seen."""
    cfg = _config(tmp_path, redis_url, disk={"policy": "seen", "min_seen": 2},
                  redis={"policy": "seen", "min_seen": 2, "reused_prompt_share": 0.9})
    assert cfg.tiers[1].admission.reused_prompt_share == 0.5  # the default
    with build_store(cfg) as store:
        store.put_many([(_k(1), _t(1), None), (_k(2), _t(2), None)], reused_shares=[share, None])
        assert _held(store, _k(1)) == admitted
        assert _held(store, _k(2)) == [True, False, False]  # no request in the same put: waits for min_seen
        refused = admitted.count(False) + 2
        assert _counter(store, "disk", "writes_refused") + _counter(store, "redis", "writes_refused") == refused


def test_reuse_admits_nothing_when_off(tmp_path):
    with build_store(_config(tmp_path, disk={"policy": "seen", "min_seen": 2, "reused_prompt_share": None})) as store:
        store.put_many([(_k(1), _t(1), None)], reused_shares=[1.0])
        assert _held(store, _k(1)) == [True, False]


# ------------------------------------------------------------------ dead on arrival: a parent held nowhere
def _child(i: int | str, parent: int | str, seed: int = 0) -> tuple[StoreKey, torch.Tensor, dict]:
    return _k(i), _t(seed), {PARENT_KEY: _k(parent).digest}


def _write_through(tmp_path) -> StoreConfig:
    return _config(tmp_path, disk={"policy": "always"})


def test_a_chain_whose_parent_is_held_nowhere_stays_in_memory(tmp_path):
    """A put naming a parent no tier holds: that record and the ones below it in the put are written to
    memory only (a lookup stops at the missing parent), counted refused on the disk; a chain put whole,
    or continuing a parent some tier holds, is written down as before."""
    with build_store(_write_through(tmp_path)) as store:
        store.put_many([(_k("root"), _t(1), None), _child("a", "root", 2), _child("b", "a", 3)])
        assert [_held(store, _k(n)) for n in ("root", "a", "b")] == [[True, True]] * 3
        store.put_many([_child("c", "b", 4)])  # its parent is held: written down
        assert _held(store, _k("c")) == [True, True]
        store.put_many([_child("x", "never-put", 5), _child("y", "x", 6), (_k("z"), _t(7), None)])
        assert [_held(store, _k(n)) for n in ("x", "y", "z")] == [[True, False], [True, False], [True, True]]
        assert _counter(store, "disk", "refused") == 2 and _counter(store, "disk", "puts") == 5


def test_a_parent_held_by_one_tier_is_enough_by_none_is_not(tmp_path):
    """A parent the disk lost but memory holds, or memory lost but the disk holds, still lets its child
    down (the store looks a prefix up block by block in every tier); one both lost does not."""
    with build_store(_write_through(tmp_path)) as store:
        store.put_many([(_k("p"), _t(0), None)] + [(_k(n), _t(i), {TAGS_KEY: [f"tag-{n}"]})
                                                   for i, n in enumerate(("q", "r"), 1)])
        assert store.flush(10)
        memory, disk = store.tiers
        named = lambda name: lambda r: r.text == _k(name).text  # noqa: E731
        assert disk.delete_stored(named("p"))[0] == 1 and disk.delete_stored(named("r"))[0] == 1
        assert memory.drop_tagged({"tag-q": time.time() + 1, "tag-r": time.time() + 1}) == 2
        assert [_held(store, _k(n)) for n in ("p", "q", "r")] == [[True, False], [False, True], [False, False]]
        store.put_many([_child("p-child", "p", 3)])
        store.put_many([_child("q-child", "q", 4)])
        store.put_many([_child("r-child", "r", 5)])
        assert [_held(store, _k(n)) for n in ("p-child", "q-child", "r-child")] == [
            [True, True], [True, True], [True, False]]
        assert _counter(store, "disk", "refused") == 1


@pytest.mark.parametrize("how", [{"always_admit": True}, {"urgent": True}])
def test_exempt_puts_write_down_orphans_too(tmp_path, how):
    """Precomputed corpora and hand-offs another engine waits for are written as they are asked."""
    with build_store(_write_through(tmp_path)) as store:
        store.put_many([_child("x", "never-put", 5)], **how)
        assert _held(store, _k("x")) == [True, True]


def test_the_records_left_after_the_dead_keep_their_reused_shares(tmp_path):
    """The dead records leave the put before the tier's own rule: the others keep their own reused share
    (a record reusing its prompt is admitted at once, one that did not waits for min_seen)."""
    with build_store(_config(tmp_path)) as store:  # disk: seen, min_seen 2, reused_prompt_share 0.5
        store.put_many([_child("x", "never-put", 1), _child("y", "x", 2), (_k("fresh"), _t(3), None),
                        (_k("reused"), _t(4), None)], reused_shares=[0.9, 0.9, 0.0, 0.9])
        assert [_held(store, _k(n)) for n in ("x", "y", "fresh", "reused")] == [
            [True, False], [True, False], [True, False], [True, True]]
        assert _counter(store, "disk", "refused") == 2 and _counter(store, "disk", "writes_refused") == 1
