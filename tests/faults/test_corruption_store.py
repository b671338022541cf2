"""Stored records corrupted on purpose, on disk and in a real redis-server: bit flips in the header and
the payload, truncation, zero length, appended bytes, garbage, swapped and copied records.

Why: a corrupt record must never become model input. Each one has to be detected, counted in the
tier's ``corrupt`` counter and removed, while the intact records beside it keep hitting. Every kind of
damage hits many records at random offsets (seeded, so a failure reproduces).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.store_workers import expected_meta, expected_tensor, fault_key, matches
from vllm_tiercache.shared.store import build_store, records
from vllm_tiercache.shared.store.tiers.redis.tier import RedisTier
from vllm_tiercache.tools.redis_server import RedisServer

#: Records corrupted on disk per kind; 8 kinds -> 144 corrupted records (at least 100 were asked for).
PER_KIND_DISK = 18
GOOD_DISK = 40


def _payload_offset(raw: bytes) -> int:
    return records.decode_header(raw).payload_offset


def _flip(raw: bytearray, lo: int, hi: int, rng: random.Random) -> None:
    raw[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)


def _header_flip(raw: bytearray, rng: random.Random) -> bytearray:
    """Anywhere before the payload: magic, version, lengths, checksums, cbor header, zero padding."""
    _flip(raw, 0, _payload_offset(bytes(raw)), rng)
    return raw


def _payload_flip(raw: bytearray, rng: random.Random) -> bytearray:
    _flip(raw, _payload_offset(bytes(raw)), len(raw), rng)
    return raw


def _truncate(raw: bytearray, rng: random.Random) -> bytearray:
    return raw[:rng.randrange(1, len(raw))]


def _zero_length(raw: bytearray, rng: random.Random) -> bytearray:
    return bytearray()


def _append(raw: bytearray, rng: random.Random) -> bytearray:
    return raw + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))


def _garbage(raw: bytearray, rng: random.Random) -> bytearray:
    return bytearray(rng.randbytes(len(raw)))


DISK_KINDS: dict[str, Callable[[bytearray, random.Random], bytearray]] = {
    "header bit flip": _header_flip,
    "payload bit flip": _payload_flip,
    "truncated": _truncate,
    "zero length": _zero_length,
    "bytes appended": _append,
    "random bytes": _garbage,
}


def test_corrupt_disk_records_are_detected_counted_and_removed(tmp_path: Path) -> None:
    """144 of 184 records damaged in 8 ways; a fresh memory+disk store serves none of them."""
    rng = random.Random(6)
    path = str(tmp_path / "d")
    config = {"tiers": [{"kind": "memory", "capacity": "64MiB"},
                        {"kind": "disk", "path": path, "capacity": "1GiB"}]}
    n_bad = PER_KIND_DISK * (len(DISK_KINDS) + 2)
    ids = list(range(n_bad + GOOD_DISK))
    with build_store(config) as store:
        store.put_many([(fault_key(i), expected_tensor(i), expected_meta(i)) for i in ids])
        assert store.flush(120)
    disk_path = {i: Path(path) / fault_key(i).hex[:2] / f"{fault_key(i).hex}.rec" for i in ids}
    kinds: dict[int, str] = {}
    it = iter(rng.sample(ids, len(ids)))
    for kind, damage in DISK_KINDS.items():
        for _ in range(PER_KIND_DISK):
            i = next(it)
            p = disk_path[i]
            p.write_bytes(bytes(damage(bytearray(p.read_bytes()), rng)))
            kinds[i] = kind
    for _ in range(PER_KIND_DISK // 2):  # swapped pairs: both records now hold the other's bytes
        a, b = next(it), next(it)
        ra, rb = disk_path[a].read_bytes(), disk_path[b].read_bytes()
        disk_path[a].write_bytes(rb)
        disk_path[b].write_bytes(ra)
        kinds[a] = kinds[b] = "swapped with another record"
    for _ in range(PER_KIND_DISK):  # one record's file copied over another's
        a, b = next(it), next(it)
        disk_path[b].write_bytes(disk_path[a].read_bytes())
        kinds[b] = "another record's file copied over it"
    good = [i for i in ids if i not in kinds]
    assert len(kinds) == n_bad >= 100 and len(good) >= GOOD_DISK
    assert Counter(kinds.values())["swapped with another record"] == PER_KIND_DISK

    with build_store(config) as store:  # fresh process state: nothing in memory
        recs = store.get_many([fault_key(i) for i in ids])
        served_bad = [(i, kinds[i]) for i, r in zip(ids, recs, strict=True) if i in kinds and r is not None]
        assert served_bad == []
        assert all(r is not None and matches(i, r) for i, r in zip(ids, recs, strict=True) if i not in kinds)
        disk = store.stats()["tiers"]["disk"]
        assert disk["corrupt"] == n_bad, disk
        assert disk["entries"] == len(good), disk
        assert not any(disk_path[i].exists() for i in kinds)
        assert store.contains_many([fault_key(i) for i in kinds]) == [False] * n_bad
        # a second read is a plain miss (already removed), and good records still hit
        assert store.get_many([fault_key(i) for i in kinds]) == [None] * n_bad
        assert store.stats()["tiers"]["disk"]["corrupt"] == n_bad
    with build_store(config) as store:
        assert all(r is not None for r in store.get_many([fault_key(i) for i in good]))


# ------------------------------------------------------------------------------------------- redis
def _names(tier: RedisTier, i: int) -> tuple[str, str, str]:
    key = fault_key(i)
    return tier._head(key), tier._part(key, 0), tier._text_name(key)


@pytest.mark.redis
def test_corrupt_redis_values_are_detected_counted_and_removed(redis_url: str,
                                                               redis_server: RedisServer) -> None:
    """72 records damaged in 12 ways straight in redis-server; none is served, all are deleted whole. A part 0
    deleted is what Redis's eviction does: counted ``partial``, not ``corrupt``; a part count one too high
    (its last part absent) is damage all the same."""
    from vllm_tiercache.shared.config import StoreConfig

    rng = random.Random(7)
    cfg = StoreConfig.from_dict({"tiers": [{"kind": "redis", "url": redis_url, "part_size": "4KiB"}]})
    tier = RedisTier(cfg.tiers[0])
    per_kind = 6
    ids = list(range(12 * per_kind + 24))
    tier.put_many([(fault_key(i), expected_tensor(i), expected_meta(i)) for i in ids])
    kinds: dict[int, str] = {}
    it = iter(rng.sample(ids, len(ids)))
    with redis_server.client() as c:

        def damage(kind: str, change: Callable[[int, str, str], None]) -> None:
            for _ in range(per_kind):
                i = next(it)
                head, part0, _ = _names(tier, i)
                change(i, head, part0)
                kinds[i] = kind

        def flip_value(name: str, lo: int = 0, hi: int | None = None) -> None:
            val = bytearray(c.get(name))
            _flip(val, lo, len(val) if hi is None else hi, rng)
            c.set(name, bytes(val))

        damage("head header bit flip", lambda i, h, p: flip_value(h, 4))
        damage("part count 0", lambda i, h, p: c.setrange(h, 0, b"\0\0\0\0"))
        damage("part count huge", lambda i, h, p: c.setrange(h, 0, b"\xff\xff\xff\x7f"))
        damage("part count +1", lambda i, h, p: c.setrange(
            h, 0, (int.from_bytes(c.getrange(h, 0, 3), "little") + 1).to_bytes(4, "little")))
        damage("part 0 bit flip", lambda i, h, p: flip_value(p))
        damage("head truncated", lambda i, h, p: c.set(h, c.get(h)[:rng.randrange(0, 40)]))
        damage("part 0 truncated", lambda i, h, p: c.set(p, c.get(p)[:-rng.randrange(1, 100)]))
        damage("part 0 zero length", lambda i, h, p: c.set(p, b""))
        damage("part 0 missing", lambda i, h, p: c.delete(p))
        damage("last part bit flip", lambda i, h, p: flip_value(
            f"{h}:{int.from_bytes(c.getrange(h, 0, 3), 'little') - 1}"))
        damage("head random bytes", lambda i, h, p: c.set(h, rng.randbytes(len(c.get(h)))))
        for _ in range(per_kind // 2):  # swapped records: heads and parts exchanged
            a, b = next(it), next(it)
            for na, nb in zip(_names(tier, a)[:2], _names(tier, b)[:2], strict=True):
                va, vb = c.get(na), c.get(nb)
                c.set(na, vb)
                c.set(nb, va)
            kinds[a] = kinds[b] = "swapped with another record"
        good = [i for i in ids if i not in kinds]
        assert len(kinds) == 12 * per_kind and len(good) == 24

        recs = tier.get_many([fault_key(i) for i in ids])
        assert [(i, kinds[i]) for i, r in zip(ids, recs, strict=True) if i in kinds and r is not None] == []
        assert all(r is not None and matches(i, r) for i, r in zip(ids, recs, strict=True) if i not in kinds)
        evicted = sum(kind == "part 0 missing" for kind in kinds.values())
        assert evicted == per_kind
        assert tier.counters.get("corrupt") == len(kinds) - evicted and tier.counters.get("partial") == evicted
        # removed whole: head, every part (even behind a damaged part count) and the key text
        leftovers = {kinds[i] for i in kinds if c.keys(f"tiercache:{{{fault_key(i).hex}}}*")}
        assert leftovers == set(), leftovers
        assert not any(c.exists(_names(tier, i)[0]) for i in kinds)
        assert tier.get_many([fault_key(i) for i in kinds]) == [None] * len(kinds)
        assert tier.counters.get("corrupt") == len(kinds) - evicted and tier.counters.get("partial") == evicted
    tier.close()

