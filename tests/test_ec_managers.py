"""Encoder cache managers against vLLM 0.32's own `EncoderCacheManager`, on real manager objects.

Requests are minimal stand-ins carrying exactly what the managers read (`request_id`, `mm_features[i]
.identifier`, `get_num_encoder_embeds(i)`); the managers themselves are vLLM's class and our subclasses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from eccache.managers import LFUEncoderCacheManager, LRUEncoderCacheManager


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


@pytest.mark.parametrize("cls", [EncoderCacheManager, LRUEncoderCacheManager, LFUEncoderCacheManager])
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
        cfg = EncoderCacheManagerConfig(encoder_cache_manager_cls=f"eccache.managers.{name}",
                                        manager_config={"aging_period": 100} if "LFU" in name else {})
        resolved = cfg.get_encoder_cache_manager_obj()
        assert resolved is cls
        mgr = resolved.create_manager(cache_size=32, vllm_config=SimpleNamespace(ec_manager_config=cfg))
        assert isinstance(mgr, cls) and mgr.cache_size == 32
