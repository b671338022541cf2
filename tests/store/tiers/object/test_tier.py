"""Object tier against a real S3 store (SeaweedFS): records, many requests in flight, admin, control entries."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import StoreKey, records
from vllm_tiercache.shared.store.tiers.object.names import ObjectNames
from vllm_tiercache.shared.store.tiers.object.tier import ObjectTier
from vllm_tiercache.tools.s3_server import SECRET_KEY

pytestmark = pytest.mark.s3


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|object|{i}")


def _t(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def tier_of(s3_bucket, **fields) -> ObjectTier:
    config = StoreConfig.load({"tiers": [s3_bucket.tier_config(**fields)]}).tiers[0]
    return ObjectTier(config)


def test_put_get_contains_sizes(s3_bucket):
    tier = tier_of(s3_bucket)
    items = [(_k(i), _t(100 + i, i), {"i": i}) for i in range(20)]
    tier.put_many(items)
    keys = [_k(i) for i in range(22)]
    assert tier.contains_many(keys) == [True] * 20 + [False] * 2
    got = tier.get_many(keys)
    for i in range(20):
        assert torch.equal(got[i].tensor, items[i][1]) and got[i].meta == {"i": i}
    assert got[20:] == [None, None]
    sizes = tier.sizes_many(keys[:2] + keys[-1:])
    assert sizes[0] == records.encode(_k(0), items[0][1], {"i": 0}).nbytes and sizes[2] is None
    assert tier.counters.get("puts") == 20 and tier.counters.get("dropped_writes") == 0
    assert tier.usage()["down"] is False and tier.usage()["capacity"] == tier.capacity
    tier.close()


def test_large_records_are_read_in_ranges_and_checked_whole(s3_bucket):
    tier = tier_of(s3_bucket, range_size="64KiB")
    big, small = _t(100_000, 1), _t(100, 2)  # 400 KB: 7 ranges; one range
    tier.put_many([(_k("big"), big, {"n": 1}), (_k("small"), small, None), (_k("bad"), big, None)])
    got = tier.get_many([_k("big"), _k("small"), _k("missing")])
    assert torch.equal(got[0].tensor, big) and got[0].meta == {"n": 1} and torch.equal(got[1].tensor, small)
    assert got[2] is None
    client, name = s3_bucket.server.client(), f"tiercache/r/{_k('bad').hex}"
    body = bytearray(client.get_object(Bucket=s3_bucket.bucket, Key=name)["Body"].read())
    body[200_000] ^= 0x10  # a flipped bit in the fourth range
    client.put_object(Bucket=s3_bucket.bucket, Key=name, Body=bytes(body))
    assert tier.get_many([_k("bad")]) == [None] and tier.counters.get("corrupt") == 1
    assert tier.contains_many([_k("bad"), _k("big")]) == [False, True]
    tier.close()


def test_a_record_is_one_whole_object_named_by_its_digest(s3_bucket):
    tier = tier_of(s3_bucket, prefix="p1/")
    tier.put_many([(_k("a"), _t(1000), {"tags": ["doc:1"]})])
    client = s3_bucket.server.client()
    body = client.get_object(Bucket=s3_bucket.bucket, Key=f"p1/r/{_k('a').hex}")["Body"].read()
    rec = records.decode(body, _k("a"))  # the shared record format, whole
    assert torch.equal(rec.tensor, _t(1000)) and rec.meta == {"tags": ["doc:1"]}
    tier.close()


def test_many_requests_are_in_flight_at_once(s3_bucket):
    """A batch goes out on the pool: more than one request runs at the same moment (seen by the server's
    client threads, not by timing)."""
    tier = tier_of(s3_bucket, concurrency=8)
    tier.put_many([(_k(i), _t(10, i), None) for i in range(32)])
    in_flight, most, lock = [0], [0], threading.Lock()
    real_get = tier._calls._first_range

    def counting_get(name, part):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            barrier.wait(timeout=10)  # every pool thread must be inside a GET for any to finish
            return real_get(name, part)
        finally:
            with lock:
                in_flight[0] -= 1

    barrier = threading.Barrier(8)
    tier._calls._first_range = counting_get
    assert all(r is not None for r in tier.get_many([_k(i) for i in range(32)]))
    assert most[0] == 8
    tier.close()


@pytest.mark.parametrize("garbage", [b"", b"not a record at all", "truncated", "swapped"])
def test_garbage_under_a_records_name_is_a_counted_deleted_miss(s3_bucket, garbage):
    tier = tier_of(s3_bucket)
    tier.put_many([(_k("a"), _t(5000), None), (_k("b"), _t(10, 1), None)])
    client, name = s3_bucket.server.client(), f"tiercache/r/{_k('a').hex}"
    whole = client.get_object(Bucket=s3_bucket.bucket, Key=name)["Body"].read()
    if garbage == "truncated":
        garbage = whole[:-100]
    elif garbage == "swapped":  # another key's record under this name
        garbage = client.get_object(Bucket=s3_bucket.bucket, Key=f"tiercache/r/{_k('b').hex}")["Body"].read()
    client.put_object(Bucket=s3_bucket.bucket, Key=name, Body=garbage)
    assert tier.get_many([_k("a"), _k("b")])[0] is None
    assert tier.counters.get("corrupt") == 1
    assert tier.contains_many([_k("a"), _k("b")]) == [False, True]  # deleted
    tier.close()


def test_another_formats_record_is_a_miss_left_in_place(s3_bucket):
    tier = tier_of(s3_bucket)
    enc = bytearray(records.encode(_k("a"), _t(10)).tobytes())
    enc[4:6] = (records.VERSION + 1).to_bytes(2, "little")
    s3_bucket.server.client().put_object(Bucket=s3_bucket.bucket, Key=f"tiercache/r/{_k('a').hex}", Body=bytes(enc))
    assert tier.get_many([_k("a")]) == [None]
    assert tier.counters.get("other_format") == 1 and tier.counters.get("corrupt") == 0
    assert tier.contains_many([_k("a")]) == [True]
    tier.close()


def test_admin_lists_texts_tags_and_deletes_by_predicate(s3_bucket):
    tier = tier_of(s3_bucket)
    tier.put_many([(_k(i), _t(10, i), {"tags": [f"doc:{i % 3}"]} if i % 2 else None) for i in range(300)])
    stored = list(tier.iter_stored())
    assert len(stored) == 300
    by_text = {rec.text: rec for rec in stored}
    assert by_text["ns|object|5"].tags == ("doc:2",) and by_text["ns|object|4"].tags == ()
    assert all(rec.nbytes and rec.idle_s is not None for rec in stored)
    assert tier.delete_stored(lambda rec: "doc:2" in rec.tags, dry_run=True)[0] == 50
    deleted, nbytes = tier.delete_stored(lambda rec: "doc:2" in rec.tags)
    assert deleted == 50 and nbytes == sum(by_text[f"ns|object|{i}"].nbytes for i in range(300) if i % 6 == 5)
    assert len(list(tier.iter_stored())) == 250
    assert tier.contains_many([_k(5), _k(4)]) == [False, True]
    tier.close()


def test_control_entries_change_by_conditional_put(s3_bucket):
    # patient calls: six racing conditional PUTs on a loaded 2-core machine were seen to pass the 2 s timeout,
    # and a caller that raised left no answer to count
    a, b = tier_of(s3_bucket, timeout_s=30.0), tier_of(s3_bucket, timeout_s=30.0)
    assert a.read_control() == {}
    a.write_control({"pin:x": b"1", "inval:y": b"2"})
    b.write_control({"inval:y": None, "pin:z": b"3"})
    assert a.read_control() == {"pin:x": b"1", "pin:z": b"3"}
    results = []
    threads = [threading.Thread(target=lambda t=t: results.append(t.remove_control("pin:x"))) for t in (a, b) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 5 + [True]  # exactly one caller removed it
    assert b.read_control() == {"pin:z": b"3"}
    a.close()
    b.close()


def test_a_store_over_the_object_tier(s3_bucket, tmp_path):
    from vllm_tiercache.shared.store.tiered import TieredStore

    cfg = StoreConfig.load({"tiers": [{"kind": "memory", "capacity": "1MiB"}, s3_bucket.tier_config()]})
    store = TieredStore(cfg)
    store.put_many([(_k(i), _t(100, i), None) for i in range(10)])
    assert store.flush(30)
    store.close()
    again = TieredStore(cfg)  # a fresh process's store: only the bucket has them
    # unbounded: a cold lookup's HEADs may take longer than lookup_budget_ms on a loaded machine (its bound:
    # tests/kv/test_lookup_budget.py)
    assert again.contains_many([_k(i) for i in range(10)], shared_only=True, bounded=False) == [True] * 10
    got = again.get_many([_k(i) for i in range(10)])
    assert all(torch.equal(got[i].tensor, _t(100, i)) for i in range(10))
    again.close()


def test_no_secret_in_logs_errors_or_usage(s3_bucket, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY + "-wrong")
    tier = tier_of(s3_bucket, retry_after_s=30.0)
    tier.put_many([(_k("a"), _t(10), None)])
    tier.get_many([_k("a")])
    seen = caplog.text + repr(tier.usage()) + tier.tried()
    with pytest.raises(ConnectionError) as err:
        list(tier.iter_stored())
    seen += str(err.value)
    assert tier.down and "unreachable" in caplog.text
    assert SECRET_KEY not in seen and "credentials from env" in tier.tried()
    tier.close()


def test_names_are_the_digest_under_the_prefix():
    names = ObjectNames("pre/")
    assert names.record(_k("a")) == f"pre/r/{_k('a').hex}"
    assert names.digest_of(names.record(_k("a"))) == _k("a").hex
    assert names.digest_of("pre/sys/control") is None and names.digest_of("pre/r/xyz") is None


def test_router_events_announce_the_object_tier_by_the_media_rule(s3_bucket, tmp_path):
    """docs/operations.md's media table: STORAGE when no shared tier keeps files, DISK beside a disk tier."""
    from vllm_tiercache.kvcache.events.tracker import shared_medium
    from vllm_tiercache.shared.store.tiered import TieredStore

    alone = TieredStore(StoreConfig.load({"tiers": [{"kind": "memory"}, s3_bucket.tier_config()]}))
    with_disk = TieredStore(StoreConfig.load({"tiers": [{"kind": "memory"}, {"kind": "disk", "path": str(tmp_path)},
                                                        s3_bucket.tier_config()]}))
    try:
        assert shared_medium(alone) == "STORAGE" and shared_medium(with_disk) == "DISK"
    finally:
        alone.close()
        with_disk.close()


def test_drop_many_deletes_what_the_store_cannot_open(s3_bucket):
    tier = tier_of(s3_bucket)
    tier.put_many([(_k(i), _t(10, i), None) for i in range(3)])
    tier.drop_many([_k(0), _k(2), _k("never")])
    assert tier.contains_many([_k(0), _k(1), _k(2)]) == [False, True, False]
    tier.close()


def test_a_sealing_store_seals_what_it_puts_in_the_bucket(s3_bucket, tmp_path):
    """Issue 50's encryption at rest holds for the object tier too (the store seals, not the tier): no 64-byte
    window of any payload is in the bucket's objects (the same check finds them in a plain store's bucket),
    and only the same tenant's salt opens the record."""
    from tests.store.sealing.rings import shares_window
    from vllm_tiercache.shared.store.sealing.ring import write_new_ring
    from vllm_tiercache.shared.store.tiered import TieredStore

    def bucket_bytes(prefix: str) -> bytes:
        client = s3_bucket.server.client()
        listed = client.list_objects_v2(Bucket=s3_bucket.bucket, Prefix=prefix).get("Contents", [])
        return b"".join(client.get_object(Bucket=s3_bucket.bucket, Key=o["Key"])["Body"].read() for o in listed)

    ring = write_new_ring(str(tmp_path / "ring.json"))
    generator = torch.Generator().manual_seed(7)
    payloads = [torch.randn(4096, generator=generator) for _ in range(3)]
    for prefix, extra in (("plain/", {}), ("sealed/", {"encryption": {"ring": ring}})):
        config = {**extra, "tiers": [s3_bucket.tier_config(prefix=prefix)]}
        store = TieredStore(StoreConfig.load(config))
        keys = [_k(f"{prefix}{i}").for_tenant("tenant-a") for i in range(len(payloads))]
        store.put_many(list(zip(keys, payloads, [None] * len(payloads), strict=True)))
        assert store.flush(30)
        if prefix == "sealed/":
            got = store.get_many(keys[:1])[0]
            assert got is not None and torch.equal(got.tensor, payloads[0])
            assert store.get_many([_k(f"{prefix}0").for_tenant("tenant-b")]) == [None]
        store.close()
    plain, sealed = bucket_bytes("plain/"), bucket_bytes("sealed/")
    assert all(shares_window(p.numpy().tobytes(), plain) for p in payloads)  # the check can fail
    assert not any(shares_window(p.numpy().tobytes(), sealed) for p in payloads)


def test_a_listing_parses_its_timestamps_the_fast_way_to_botocores_values(s3_bucket, monkeypatch):
    """A sweep's listing has one timestamp per object: the tier's client parses them itself (botocore's parser
    took more than half a sweep's CPU), to the same aware datetimes botocore's gives."""
    from botocore.utils import parse_timestamp as botocore_timestamp

    from vllm_tiercache.shared.store.tiers.object import client as client_module

    parsed: list[str] = []

    def counting(value):
        parsed.append(value)
        return client_module.parse_timestamp.__wrapped__(value)

    counting.__wrapped__ = client_module.parse_timestamp
    monkeypatch.setattr(client_module, "parse_timestamp", counting)
    tier = tier_of(s3_bucket)
    tier.put_many([(_k(i), _t(10, i), None) for i in range(5)])
    ours = client_module.make_client(tier.config).list_objects_v2(Bucket=s3_bucket.bucket, Prefix="tiercache/r/")
    plain = s3_bucket.server.client().list_objects_v2(Bucket=s3_bucket.bucket, Prefix="tiercache/r/")
    assert [o["LastModified"] for o in ours["Contents"]] == [o["LastModified"] for o in plain["Contents"]]
    assert len(parsed) >= 5 and all(o["LastModified"].tzinfo is not None for o in ours["Contents"])
    tier.close()
    for text in ("2026-01-31T12:34:56.000Z", "2026-01-31T12:34:56Z", "2026-01-31T12:34:56.123456+02:00",
                 "Sat, 31 Jan 2026 12:34:56 GMT", "1769862896", "2026-01-31T12:34:56.123456789Z"):
        assert counting.__wrapped__(text) == botocore_timestamp(text), text
