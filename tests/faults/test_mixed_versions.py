"""Two builds of the product, writing different record formats, share one disk directory and one Redis.

Why: during a rolling upgrade old and new replicas use the same shared tiers. A record of another format
version used to count as corrupt and be deleted on the first read (seen: 4 records of a build with format
version 2, all deleted by the current build, on disk and in Redis), so the builds deleted each other's
records. Now each build reads its own, misses the other's without touching them, and counts those
misses as ``other_format``, never ``corrupt``.

The "other build" is this code with `records.VERSION` raised, and, as a new format must, its own
`api.KEY_SPACE`; the second test leaves the key space alone, as a build that forgot it (or the build of the
report above) would, so the records of both formats meet under one digest.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_tiercache.shared.store import api, build_store, records
from vllm_tiercache.shared.store.api import StoreKey

KEYS = [f"mixed|kv|m|fp|tp1r0|{i:04x}|Lall" for i in range(4)]


def _tiers(tmp_path: Path, redis_url: str) -> list[dict[str, Any]]:
    return [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"},
            {"kind": "redis", "url": redis_url}]


@contextmanager
def _other_build(monkeypatch: pytest.MonkeyPatch, key_space: bytes | None) -> Iterator[None]:
    with monkeypatch.context() as patch:
        patch.setattr(records, "VERSION", 2)
        if key_space is not None:
            patch.setattr(api, "KEY_SPACE", key_space)
        yield


def _tensor(build: int, i: int) -> torch.Tensor:
    return torch.full((64,), float(build * 100 + i))


def _put_and_flush(tmp_path: Path, redis_url: str, build: int) -> None:
    """Each tier on its own (a store writes slower tiers in the background; both must hold the records)."""
    for tier in _tiers(tmp_path, redis_url):
        store = build_store({"namespace": "mixed", "tiers": [tier]})
        try:
            store.put_many([(StoreKey(text), _tensor(build, i), None) for i, text in enumerate(KEYS)])
        finally:
            store.close()


def _read(tmp_path: Path, redis_url: str, build: int) -> list[dict[str, Any]]:
    """Per tier: which records this build got back intact, and the tier's counters."""
    out = []
    for tier in _tiers(tmp_path, redis_url):
        store = build_store({"namespace": "mixed", "tiers": [tier]})
        try:
            got = store.get_many([StoreKey(text) for text in KEYS])
            intact = [r is not None and torch.equal(r.tensor, _tensor(build, i)) for i, r in enumerate(got)]
            counters = store.stats()["tiers"][store.tiers[0].name]
            out.append({"intact": intact, "corrupt": counters["corrupt"],
                        "other_format": counters["other_format"]})
        finally:
            store.close()
    return out


@pytest.mark.parametrize("own_key_space", [True, False], ids=["own key space", "shared digests"])
def test_each_build_reads_its_own_records_and_deletes_none_of_the_other(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, own_key_space: bool
) -> None:
    space = b"tiercache-f2" if own_key_space else None
    with _other_build(monkeypatch, space):
        _put_and_flush(tmp_path, redis_url, build=2)
    if own_key_space:  # both builds' records live side by side
        _put_and_flush(tmp_path, redis_url, build=1)
        for tier in _read(tmp_path, redis_url, build=1):
            assert tier == {"intact": [True] * 4, "corrupt": 0, "other_format": 0}
    else:  # the current build finds the other format under its digests: a miss, counted apart, left alone
        for tier in _read(tmp_path, redis_url, build=1):
            assert tier == {"intact": [False] * 4, "corrupt": 0, "other_format": 4}
    with _other_build(monkeypatch, space):
        for tier in _read(tmp_path, redis_url, build=2):
            assert tier == {"intact": [True] * 4, "corrupt": 0, "other_format": 0}


def test_other_format_is_told_apart_from_damage() -> None:
    encoded = records.encode(StoreKey(KEYS[0]), torch.zeros(4), None)
    raw = bytearray(encoded.tobytes())
    raw[4] = 2  # the format version field, right after the magic
    with pytest.raises(records.OtherFormatError, match="format version 2"):
        records.decode_header(bytes(raw))
    raw[0] ^= 1  # and a damaged magic is corruption, not another format
    with pytest.raises(records.RecordError) as err:
        records.decode_header(bytes(raw))
    assert not isinstance(err.value, records.OtherFormatError)
