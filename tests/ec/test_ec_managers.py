"""Encoder cache managers against vLLM 0.32's own `EncoderCacheManager`, on real manager objects.

Requests are minimal stand-ins carrying exactly what the managers read (`request_id`, `mm_features[i]
.identifier`, `get_num_encoder_embeds(i)`); the managers themselves are vLLM's class and our subclasses.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import pytest
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from vllm_tiercache.eccache.managers import (
    FIXED_POLICY_MANAGERS,
    LFUEncoderCacheManager,
    LRUEncoderCacheManager,
    PolicyEncoderCacheManager,
    WTinyLFUEncoderCacheManager,
)


@dataclass
class _Feature:
    identifier: str


@dataclass
class _Req:
    request_id: str
    hashes: list[str]
    sizes: list[int] = field(default_factory=list)

    @property
    def mm_features(self) -> list[_Feature]:
        return [_Feature(h) for h in self.hashes]

    def get_num_encoder_embeds(self, i: int) -> int:
        return self.sizes[i] if self.sizes else 4


def _use(mgr: EncoderCacheManager, req: _Req) -> bool:
    """Schedule every input of `req` like the scheduler: hit, else make room and allocate. True if all hit."""
    hits = True
    for i in range(len(req.hashes)):
        if mgr.check_and_update_cache(req, i):
            continue
        hits = False
        assert mgr.can_allocate(req, i, 10**9, 0)
        mgr.allocate(req, i)
    return hits


def _sequence(mgr: EncoderCacheManager) -> list[str]:
    """Capacity 2 entries. Y is held by a long request; X is hit last by a short one, released first."""
    a = _Req("A", ["Y"])  # long request, holds Y from the start
    _use(mgr, a)
    b = _Req("B", ["X"])
    _use(mgr, b)
    mgr.free(b)
    c = _Req("C", ["X"])  # X is hit again: the most recently used entry
    assert _use(mgr, c)
    mgr.free(c)
    mgr.free(a)  # Y released last, but last *used* long before X
    d = _Req("D", ["Z"])
    _use(mgr, d)
    return mgr.get_freed_mm_hashes()


def test_fifo_evicts_just_hit_entry_lru_keeps_it() -> None:
    assert _sequence(EncoderCacheManager(cache_size=8)) == ["X"]
    assert _sequence(LRUEncoderCacheManager(cache_size=8)) == ["Y"]


def test_lfu_keeps_frequent_entry() -> None:
    mgr = LFUEncoderCacheManager(cache_size=8)
    for n in range(5):  # P is popular
        r = _Req(f"p{n}", ["P"])
        _use(mgr, r)
        mgr.free(r)
    r = _Req("q", ["Q"])
    _use(mgr, r)
    mgr.free(r)
    _use(mgr, _Req("z", ["Z"]))
    assert mgr.get_freed_mm_hashes() == ["Q"]  # Q is newer, but P is used 5x more


#: vLLM's manager and one manager per registered policy (LRU, LFU, W-TinyLFU and any policy added later)
FIXED_MANAGERS = [EncoderCacheManager, *FIXED_POLICY_MANAGERS.values()]


def test_each_registered_policy_has_its_manager_class_loadable_by_vllm() -> None:
    """One class per policy, made from the registry, at the path vLLM resolves; the public names stay."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_tiercache.eccache import managers
    from vllm_tiercache.shared.eviction import policy_class_name, policy_names

    assert list(FIXED_POLICY_MANAGERS) == list(policy_names())
    for policy, cls in FIXED_POLICY_MANAGERS.items():
        name = policy_class_name(policy).removesuffix("Policy") + "EncoderCacheManager"
        assert cls.__name__ == cls.__qualname__ == name and cls.__module__ == managers.__name__
        assert resolve_obj_by_qualname(f"{managers.__name__}.{name}") is cls is managers.manager_class(policy)
        assert issubclass(cls, PolicyEncoderCacheManager) and cls.policy_name == policy and cls.__doc__
        assert cls(cache_size=8).policy_name == policy
    assert (LRUEncoderCacheManager.policy_name, LFUEncoderCacheManager.policy_name,
            WTinyLFUEncoderCacheManager.policy_name) == ("lru", "lfu", "wtinylfu")


@pytest.mark.parametrize("cls", FIXED_MANAGERS)
def test_invariants_under_random_traffic(cls: type[EncoderCacheManager]) -> None:
    """Capacity is never exceeded, referenced entries are never evicted, counters stay consistent."""
    rng = random.Random(0)
    capacity = 64
    mgr = cls(cache_size=capacity)
    live: list[_Req] = []
    for step in range(3000):
        if live and (rng.random() < 0.5 or len(live) > 12):
            mgr.free(live.pop(rng.randrange(len(live))))
        hashes = [f"img{int(rng.paretovariate(1.0)) % 200}" for _ in range(rng.randint(1, 2))]
        hashes = list(dict.fromkeys(hashes))
        req = _Req(f"r{step}", hashes, [rng.choice([4, 8, 16]) for _ in hashes])
        for i, h in enumerate(hashes):  # the same image always has the same size
            req.sizes[i] = 4 + (int(h[3:]) % 3) * 4
        ok = True
        for i in range(len(hashes)):
            if mgr.check_and_update_cache(req, i):
                continue
            if not mgr.can_allocate(req, i, 10**9, 0):
                ok = False
                break
            mgr.allocate(req, i)
        if ok:
            live.append(req)
        else:
            mgr.free(req)
        freed = mgr.get_freed_mm_hashes()
        referenced = {h for h, refs in mgr.cached.items() if refs}
        assert not set(freed) & referenced
        for r in live:
            for h in r.hashes:
                assert h in mgr.cached and r.request_id in mgr.cached[h]
        used = sum(mgr.num_embeds_by_hash.values())
        assert used <= capacity
        assert mgr.num_free_slots == capacity - used
        unreferenced = sum(mgr.num_embeds_by_hash[h] for h, refs in mgr.cached.items() if not refs)
        assert mgr.num_freeable_slots == mgr.num_free_slots + unreferenced
        assert set(mgr.freeable) == {h for h, refs in mgr.cached.items() if not refs}


def test_managers_load_through_vllm_ec_manager_config() -> None:
    """The exact extension point vLLM's scheduler uses: EncoderCacheManagerConfig -> create_manager."""
    from types import SimpleNamespace

    from vllm.config import EncoderCacheManagerConfig

    for name, cls in (("LRUEncoderCacheManager", LRUEncoderCacheManager),
                      ("LFUEncoderCacheManager", LFUEncoderCacheManager)):
        cfg = EncoderCacheManagerConfig(encoder_cache_manager_cls=f"vllm_tiercache.eccache.managers.{name}",
                                        manager_config={"aging_period": 100} if "LFU" in name else {})
        resolved = cfg.get_encoder_cache_manager_obj()
        assert resolved is cls
        mgr = resolved.create_manager(cache_size=32, vllm_config=SimpleNamespace(ec_manager_config=cfg))
        assert isinstance(mgr, cls) and mgr.cache_size == 32


# ------------------------------------------------------------------------------ vllm_tiercache.shared.eviction policies

POLICY_MANAGERS = [*FIXED_MANAGERS, PolicyEncoderCacheManager]


@pytest.mark.parametrize("cls", POLICY_MANAGERS)
def test_can_allocate_answers_as_vllm_and_freed_contract(cls: type[EncoderCacheManager]) -> None:
    """can_allocate says yes exactly when vLLM's rule does (no starved request, no over-commit); evicted
    entries were unreferenced, leave `cached`, and are reported once by get_freed_mm_hashes."""
    rng = random.Random(3)
    capacity = 96
    mgr = cls(cache_size=capacity)
    live: list[_Req] = []
    for step in range(2000):
        if live and (rng.random() < 0.45 or len(live) > 10):
            mgr.free(live.pop(rng.randrange(len(live))))
        h = f"img{int(rng.paretovariate(0.9)) % 150}"
        size = 4 + int(h[3:]) % 4 * 6
        req = _Req(f"r{step}", [h], [size])
        if mgr.check_and_update_cache(req, 0):
            live.append(req)
            continue
        budget = rng.choice([size - 1, size, 10**9])
        to_schedule = rng.choice([0, 0, 8])
        expected = size <= budget and size + to_schedule <= mgr.num_freeable_slots
        unreferenced = {k for k, refs in mgr.cached.items() if not refs}
        assert mgr.can_allocate(req, 0, budget, to_schedule) == expected
        freed = mgr.get_freed_mm_hashes()
        assert set(freed) <= unreferenced and len(freed) == len(set(freed))
        assert not set(freed) & set(mgr.cached)
        if expected:
            assert mgr.num_free_slots >= size + to_schedule
            mgr.allocate(req, 0)
            live.append(req)
        assert sum(mgr.num_embeds_by_hash.values()) <= capacity


def test_policy_manager_selected_by_config(tmp_path, monkeypatch) -> None:
    """`manager_config["policy"]` first, then the EC connector's `encoder_cache_policy`, then the default."""
    from types import SimpleNamespace

    from vllm.config import EncoderCacheManagerConfig

    from vllm_tiercache.shared.eviction import DEFAULT_POLICY, LFUPolicy, LRUPolicy, WTinyLFUPolicy

    def build(manager_config: dict, extra: dict | None) -> PolicyEncoderCacheManager:
        cfg = EncoderCacheManagerConfig(
            encoder_cache_manager_cls="vllm_tiercache.eccache.managers.PolicyEncoderCacheManager",
            manager_config=manager_config)
        assert cfg.get_encoder_cache_manager_obj() is PolicyEncoderCacheManager
        ec = SimpleNamespace(ec_connector_extra_config=extra) if extra is not None else None
        vllm_config = SimpleNamespace(ec_manager_config=cfg, ec_transfer_config=ec)
        return PolicyEncoderCacheManager.create_manager(cache_size=64, vllm_config=vllm_config)

    assert isinstance(build({"policy": "lru"}, {"encoder_cache_policy": "wtinylfu"}).policy, LRUPolicy)
    assert isinstance(build({}, {"encoder_cache_policy": "lfu"}).policy, LFUPolicy)
    monkeypatch.delenv("TIERCACHE_CONFIG", raising=False)
    (tmp_path / "store.json").write_text('{"encoder_cache_policy": "wtinylfu", "tiers": [{"kind": "memory"}]}')
    assert isinstance(build({}, {"config_file": str(tmp_path / "store.json")}).policy, WTinyLFUPolicy)
    mgr = build({"window_fraction": 0.05}, {"encoder_cache_policy": "wtinylfu"})
    assert isinstance(mgr.policy, WTinyLFUPolicy) and mgr.policy.window_max == 3
    assert build({}, None).policy_name == DEFAULT_POLICY
    from vllm_tiercache.shared.eviction import policy_names

    allowed = re.escape(", ".join(policy_names()))  # every registered policy: lru, lfu, wtinylfu, ...
    with pytest.raises(ValueError, match=rf"encoder_cache_policy: invalid value 'no-such-policy'; allowed: {allowed}$"):
        build({"policy": "no-such-policy"}, None)
    mgr = build({}, None)
    mgr.reset()  # reset rebuilds the same policy, empty
    assert mgr.policy_name == DEFAULT_POLICY and len(mgr.policy) == 0


def _gap_closed(policy: str, trace: list[int], capacity: int) -> float:
    from vllm_tiercache.tools.bench import policy as pb

    rates = {}
    for label, mgr in (("vLLM", EncoderCacheManager(cache_size=capacity)),
                       ("policy", PolicyEncoderCacheManager(cache_size=capacity, policy=policy))):
        rates[label] = pb._rate(pb.replay(mgr, trace, None, 16, seed=7))
    belady = PolicyEncoderCacheManager(cache_size=capacity, policy="lru")
    belady.policy = pb.BeladyPolicy(capacity, trace)
    rates["Belady"] = pb._rate(pb.replay(belady, trace, None, 16, seed=7))
    return pb.gap(rates["policy"], rates["vLLM"], rates["Belady"])


def test_default_policy_closes_most_of_the_gap_to_belady_on_zipf_1_0_at_5_percent() -> None:
    """A seeded, smaller version of `tiercache bench policy`'s headline row (1,000 images, 8,000 requests)."""
    from vllm_tiercache.shared.eviction import DEFAULT_POLICY
    from vllm_tiercache.tools.bench import policy as pb

    trace = pb.zipf_trace(8000, 1000, 1.0, seed=1000)
    capacity = 50 * pb.EMBEDS_PER_IMAGE
    assert _gap_closed(DEFAULT_POLICY, trace, capacity) >= 0.55
    assert _gap_closed("lru", trace, capacity) < 0.05  # recency alone changes nothing on this traffic


@pytest.mark.parametrize("policy", ["lfu", "wtinylfu"])
def test_scan_does_not_flush_the_popular_set(policy: str) -> None:
    """A one-off sweep over the whole corpus mid-trace: one capacity's worth of requests after it, the hit
    rate is back to within 5 points of what it was before (LRU, for contrast, loses its whole hot set)."""
    from vllm_tiercache.tools.bench import policy as pb

    trace, start, end = pb.scan_trace(6000, 600, 1.0, seed=1000)
    capacity_entries = 30
    mgr = PolicyEncoderCacheManager(cache_size=capacity_entries * pb.EMBEDS_PER_IMAGE, policy=policy)
    hits = pb.replay(mgr, trace, None, 16, seed=7)
    before, after = pb.scan_recovery(hits, start, end, capacity_entries, window=1000)
    assert after >= before - 0.05, (before, after)
    right_after = pb._rate(hits, end, end + capacity_entries)
    lru_hits = pb.replay(LRUEncoderCacheManager(cache_size=capacity_entries * pb.EMBEDS_PER_IMAGE), trace, None,
                         16, seed=7)
    assert right_after > pb._rate(lru_hits, end, end + capacity_entries)


# ------------------------------------------------------------------------------------ manager_config checks


def _create(cls_name: str, manager_config: dict, extra: dict | None = None) -> EncoderCacheManager:
    """A manager built as vLLM's scheduler builds it, from `--ec-manager-config`."""
    from types import SimpleNamespace

    from vllm.config import EncoderCacheManagerConfig

    cfg = EncoderCacheManagerConfig(encoder_cache_manager_cls=f"vllm_tiercache.eccache.managers.{cls_name}",
                                    manager_config=manager_config)
    ec = SimpleNamespace(ec_connector_extra_config=extra) if extra is not None else None
    return cfg.get_encoder_cache_manager_obj().create_manager(
        cache_size=64, vllm_config=SimpleNamespace(ec_manager_config=cfg, ec_transfer_config=ec))


@pytest.mark.parametrize(("cls_name", "manager_config", "message"), [
    # both used to be ignored without a word
    ("LRUEncoderCacheManager", {"aging_period": 100},
     "manager_config.aging_period: unknown option for policy 'lru' (LRUEncoderCacheManager); allowed: policy only"),
    ("LRUEncoderCacheManager", {"policy": "wtinylfu"},
     "manager_config.policy: invalid value 'wtinylfu'; allowed: 'lru' or no policy: LRUEncoderCacheManager always "
     "uses 'lru'; to choose the policy, set encoder_cache_manager_cls to "
     "vllm_tiercache.eccache.managers.PolicyEncoderCacheManager"),
    ("LFUEncoderCacheManager", {"policy": "lru"}, "manager_config.policy: invalid value 'lru'; allowed: 'lfu'"),
    ("PolicyEncoderCacheManager", {"policy": "wtinylfu", "window_fractoin": 0.05},
     "manager_config.window_fractoin: unknown option for policy 'wtinylfu' (PolicyEncoderCacheManager); did you "
     "mean 'window_fraction'? allowed: policy, window_fraction, protected_fraction, size_aware, victim_sample"),
    ("PolicyEncoderCacheManager", {"window_fraction": 0.05},  # the default policy (lfu) has no window
     "manager_config.window_fraction: unknown option for policy 'lfu' (PolicyEncoderCacheManager, the default "
     "policy); allowed: policy, aging_period, history_size, size_aware"),
    ("LFUEncoderCacheManager", {"aging_period": -1}, "manager_config.aging_period: invalid value -1; allowed: an int"),
    ("LFUEncoderCacheManager", {"history_size": "big"}, "manager_config.history_size: invalid value 'big'"),
    ("WTinyLFUEncoderCacheManager", {"window_fraction": 1.5},
     "manager_config.window_fraction: invalid value 1.5; allowed: a number strictly between 0 and 1"),
    ("WTinyLFUEncoderCacheManager", {"size_aware": "yes"}, "manager_config.size_aware: invalid value 'yes'"),
    ("WTinyLFUEncoderCacheManager", {"victim_sample": 0}, "manager_config.victim_sample: invalid value 0"),
])
def test_a_wrong_manager_config_is_an_error_naming_the_option(cls_name, manager_config, message) -> None:
    from vllm_tiercache.shared.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _create(cls_name, manager_config)
    assert str(info.value).startswith(message), str(info.value)


def test_the_options_a_policy_takes_are_accepted() -> None:
    from vllm_tiercache.shared.eviction import LFUPolicy, LRUPolicy, WTinyLFUPolicy

    assert isinstance(_create("LRUEncoderCacheManager", {"policy": "lru"}).policy, LRUPolicy)
    lfu = _create("LFUEncoderCacheManager", {"aging_period": 0, "history_size": 10, "size_aware": False})
    assert isinstance(lfu.policy, LFUPolicy) and lfu.policy.history_size == 10 and not lfu.policy.size_aware
    w = _create("PolicyEncoderCacheManager", {"policy": "wtinylfu", "window_fraction": 0.5, "protected_fraction": 0.5,
                                              "victim_sample": 4, "size_aware": True})
    assert isinstance(w.policy, WTinyLFUPolicy) and w.policy.victim_sample == 4
    # the EC connector's policy picks which options are allowed
    assert isinstance(_create("PolicyEncoderCacheManager", {"victim_sample": 2},
                              {"encoder_cache_policy": "wtinylfu"}).policy, WTinyLFUPolicy)


def test_direct_construction_checks_options_too() -> None:
    """vLLM's own tests build managers as `cls(cache_size=...)`; that still works, and options are checked."""
    from vllm_tiercache.shared.config import ConfigError

    for cls in (LRUEncoderCacheManager, LFUEncoderCacheManager, WTinyLFUEncoderCacheManager, PolicyEncoderCacheManager):
        assert cls(cache_size=10).cache_size == 10
        assert cls(10).cache_size == 10
    with pytest.raises(ConfigError, match=r"manager_config\.aging_period: unknown option for policy 'lru'"):
        LRUEncoderCacheManager(cache_size=10, aging_period=3)
    with pytest.raises(ConfigError, match=r"manager_config\.policy: invalid value 'lfu'; allowed: 'wtinylfu'"):
        WTinyLFUEncoderCacheManager(cache_size=10, policy="lfu")
