"""The object tier's packs (`packs`, ``layout: chunk``): a KV chunk's layer records in one object, read with
one GET, checked whole; a pack with members gone is a counted miss, a damaged one a deleted miss, another
build's (another layout, another pack version) a miss left in place. Against the session's SeaweedFS."""

from __future__ import annotations

import pytest
import torch

from tests.support.waiting import wait_until
from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
from vllm_tiercache.shared.naming.keys import EncoderIdentity, KVModelIdentity, encoder_key, kv_chunk_key
from vllm_tiercache.shared.store import StoreKey, records
from vllm_tiercache.shared.store.tags import TAGS_KEY
from vllm_tiercache.shared.store.tiers.object.names import MEMBERS_FIELD, ObjectNames
from vllm_tiercache.shared.store.tiers.object.packs import PACK_VERSION, Group, PackLayout, joined, pack_key_of
from vllm_tiercache.shared.store.tiers.object.tier import ObjectTier

IDENTITY = KVModelIdentity("m", "bfloat16", 4, 2, 64, 32, "nhd", 1, 0)
LAYERS = 4


def layer_keys(chunk: bytes, group: str | None = None) -> list[StoreKey]:
    return [kv_chunk_key("ns", IDENTITY, chunk, layer, group) for layer in range(LAYERS)]


def tensor(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(seed))


def chunk_items(chunk: bytes, seed: int = 0, parent: bytes | None = None, layers=range(LAYERS)):
    keys = layer_keys(chunk)
    parents = layer_keys(parent) if parent else None
    return [(keys[layer], tensor(seed + layer),
             {"blocks": 2, TAGS_KEY: ["doc:a"], **({PARENT_KEY: parents[layer].digest} if parents else {})})
            for layer in layers]


def tier_of(s3_bucket, **fields) -> ObjectTier:
    return ObjectTier(StoreConfig.load({"tiers": [s3_bucket.tier_config(**fields)]}).tiers[0])


@pytest.fixture
def tier(s3_bucket):
    """An object tier of the default layout on a new bucket, closed after the test."""
    made = tier_of(s3_bucket)
    yield made
    made.close()


def objects(s3_bucket, tier: ObjectTier) -> list[str]:
    return sorted(obj["Key"] for obj in tier._calls.list_names(ObjectNames(tier.config.prefix).records))


class CountingGets:
    """Wraps the tier's GET of an object's first range: the names that reached the network."""

    def __init__(self, tier: ObjectTier) -> None:
        self.names: list[str] = []
        self._real = tier._calls._first_range
        tier._calls._first_range = self

    def __call__(self, name: str, part: int):
        self.names.append(name)
        return self._real(name, part)


def test_a_kv_layer_key_belongs_to_its_chunks_pack_and_nothing_else_is_packed():
    keys = layer_keys(b"\x01" * 8)
    assert {pack_key_of(key).text for key in keys} == {kv_chunk_key("ns", IDENTITY, b"\x01" * 8, None).text}
    grouped = layer_keys(b"\x01" * 8, "sw-128-32")
    assert pack_key_of(grouped[2]).text == kv_chunk_key("ns", IDENTITY, b"\x01" * 8, None, "sw-128-32").text
    assert pack_key_of(grouped[0]) != pack_key_of(keys[0])  # a KV cache group's layers: a pack of their own
    assert pack_key_of(StoreKey(keys[0].text, tenant="t")).tenant == "t"
    for alone in (kv_chunk_key("ns", IDENTITY, b"\x01" * 8, None),  # an all-layer record (the event journal's)
                  kv_chunk_key("ns", IDENTITY, b"\x01" * 8, None, "events"),
                  encoder_key("ns", EncoderIdentity("m", "fp"), "mm-hash"), StoreKey("ns|kv|direct|L0"),
                  StoreKey("bench|L3")):
        assert pack_key_of(alone) is None


@pytest.mark.s3
def test_a_chunks_layers_are_one_object_read_with_one_get(s3_bucket, tier):
    items = chunk_items(b"\x01" * 8) + chunk_items(b"\x02" * 8, seed=10)
    tier.put_many(items)
    names = ObjectNames(tier.config.prefix)
    packs = [names.record(pack_key_of(items[0][0])), names.record(pack_key_of(items[-1][0]))]
    assert objects(s3_bucket, tier) == sorted(packs)
    head = s3_bucket.server.client().head_object(Bucket=s3_bucket.bucket, Key=packs[0])
    assert head["Metadata"][MEMBERS_FIELD] == str(LAYERS)
    assert tier.counters.get("puts") == 2 * LAYERS
    gets = CountingGets(tier)
    got = tier.get_many([key for key, _, _ in items])
    assert sorted(gets.names) == sorted(packs)  # one GET per chunk, not per layer
    for (_, want, meta), rec in zip(items, got, strict=True):
        assert rec is not None and torch.equal(rec.tensor, want) and rec.meta == meta
        # in a buffer of its own: a layer the memory tier keeps does not hold its whole pack
        assert rec.tensor.untyped_storage().nbytes() < 2 * want.numel() * want.element_size()
    assert tier.contains_many([key for key, _, _ in items] + layer_keys(b"\x03" * 8)) == [True] * 8 + [False] * 4
    assert tier.sizes_many([items[0][0]]) == [head["ContentLength"] // LAYERS]
    assert sorted((r.text, r.tags) for r in tier.iter_stored()) == sorted(
        (pack_key_of(items[i][0]).text, ("doc:a",)) for i in (0, LAYERS))
    tier.drop_many([items[0][0]])  # the others may be records memory let go of: the pack stays
    assert all(rec is not None for rec in tier.get_many([key for key, _, _ in items[:LAYERS]]))
    tier.drop_many([key for key, _, _ in items[:LAYERS]])  # all of its members: the pack goes
    assert tier.get_many([key for key, _, _ in items[:LAYERS]]) == [None] * LAYERS
    assert objects(s3_bucket, tier) == [packs[1]]
    assert tier.counters.get("corrupt") == 0 and tier.counters.get("partial") == 0


@pytest.mark.s3
def test_a_later_put_of_some_layers_keeps_the_others_this_process_wrote(s3_bucket, tier):
    tier.put_many(chunk_items(b"\x01" * 8))
    again = chunk_items(b"\x01" * 8, seed=50, layers=[2])  # a memory tier demoting one layer on its own
    tier.put_many(again)
    got = tier.get_many(layer_keys(b"\x01" * 8))
    want = [tensor(0), tensor(1), tensor(50 + 2), tensor(3)]
    assert all(rec is not None and torch.equal(rec.tensor, t) for rec, t in zip(got, want, strict=True))


@pytest.mark.s3
def test_a_pack_missing_layers_is_a_counted_partial_miss_not_damage(s3_bucket):
    first, second = tier_of(s3_bucket), tier_of(s3_bucket)  # two processes: the second knows nothing of the pack
    try:
        first.put_many(chunk_items(b"\x01" * 8))
        second.put_many(chunk_items(b"\x01" * 8, layers=[0]))
        got = first.get_many(layer_keys(b"\x01" * 8))
        assert got[0] is not None and torch.equal(got[0].tensor, tensor(0)) and got[1:] == [None] * 3
        assert first.counters.get("partial") == 3 and first.counters.get("corrupt") == 0
        # the process that wrote the pack knows what it holds: its lookups promise no more than that
        assert second.contains_many(layer_keys(b"\x01" * 8)) == [True, False, False, False]
        assert len(objects(s3_bucket, first)) == 1  # left in place: its next whole put replaces it
    finally:
        first.close()
        second.close()


@pytest.mark.s3
@pytest.mark.parametrize("where", ["pack header", "member payload", "cut short"])
def test_a_damaged_pack_is_a_counted_deleted_miss(s3_bucket, tier, where):
    items = chunk_items(b"\x01" * 8)
    tier.put_many(items)
    name = ObjectNames(tier.config.prefix).record(pack_key_of(items[0][0]))
    client = s3_bucket.server.client()
    body = bytearray(client.get_object(Bucket=s3_bucket.bucket, Key=name)["Body"].read())
    if where == "cut short":
        del body[-100:]
    else:
        body[20 if where == "pack header" else len(body) - 100] ^= 0xFF
    client.put_object(Bucket=s3_bucket.bucket, Key=name, Body=bytes(body))
    assert tier.get_many([key for key, _, _ in items]) == [None] * LAYERS
    assert tier.counters.get("corrupt") == 1 and objects(s3_bucket, tier) == []


@pytest.mark.s3
def test_each_layout_reads_the_others_kv_records_as_misses_never_damage(s3_bucket):
    packed, plain = tier_of(s3_bucket), tier_of(s3_bucket, layout="record")
    try:
        packed.put_many(chunk_items(b"\x01" * 8))
        plain.put_many(chunk_items(b"\x02" * 8))
        assert len(objects(s3_bucket, packed)) == 1 + LAYERS
        assert plain.get_many(layer_keys(b"\x01" * 8)) == [None] * LAYERS
        assert packed.get_many(layer_keys(b"\x02" * 8)) == [None] * LAYERS
        assert plain.contains_many(layer_keys(b"\x01" * 8)) == [False] * LAYERS
        for tier in (packed, plain):
            assert tier.counters.get("corrupt") == 0 and tier.counters.get("other_format") == 0
        assert len(objects(s3_bucket, packed)) == 1 + LAYERS  # nothing deleted
        assert all(rec is not None for rec in plain.get_many(layer_keys(b"\x02" * 8)))
    finally:
        packed.close()
        plain.close()


@pytest.mark.s3
@pytest.mark.parametrize("meta", [{"pack": PACK_VERSION + 1, "members": []}, {"blocks": 2}])
def test_another_pack_version_or_a_plain_record_under_a_packs_name_is_left_in_place(s3_bucket, tier, meta):
    pack = pack_key_of(layer_keys(b"\x01" * 8)[0])
    name = ObjectNames(tier.config.prefix).record(pack)
    body = joined(records.encode(pack, torch.zeros(64, dtype=torch.uint8), meta))
    s3_bucket.server.client().put_object(Bucket=s3_bucket.bucket, Key=name, Body=bytes(body))
    assert tier.get_many(layer_keys(b"\x01" * 8)) == [None] * LAYERS
    assert tier.counters.get("other_format") == 1 and tier.counters.get("corrupt") == 0
    assert objects(s3_bucket, tier) == [name]


@pytest.mark.s3
def test_a_record_alone_asked_twice_in_one_read_is_answered_twice(s3_bucket, tier):
    key = encoder_key("ns", EncoderIdentity("m", "fp"), "mm-hash")
    tier.put_many([(key, tensor(1), None)])
    got = tier.get_many([key, key])
    assert all(rec is not None and torch.equal(rec.tensor, tensor(1)) for rec in got)
    assert tier.counters.get("partial") == 0


def test_a_packs_parent_is_the_pack_of_its_members_parents():
    layout = PackLayout(pack=True)
    first, second = chunk_items(b"\x01" * 8), chunk_items(b"\x02" * 8, parent=b"\x01" * 8)
    items = first + second
    groups = layout.group([key for key, _, _ in items])
    assert [g.positions for g in groups] == [list(range(LAYERS)), list(range(LAYERS, 2 * LAYERS))]
    bodies = [layout.encode(group, items) for group in groups]
    assert bodies[0].parent is None and bodies[1].parent == pack_key_of(first[0][0]).hex
    assert bodies[1].members == LAYERS and bodies[1].tags == ("doc:a",)
    plain = PackLayout(pack=False).group([key for key, _, _ in items])
    assert [g.packed for g in plain] == [False] * 2 * LAYERS and plain[LAYERS].key == second[0][0]
    assert PackLayout(pack=False).encode(plain[LAYERS], items).parent == first[0][0].hex


def test_a_pack_member_entry_outside_the_payload_is_damage():
    layout = PackLayout(pack=True)
    items = chunk_items(b"\x01" * 8)
    group = layout.group([key for key, _, _ in items])[0]
    bad = joined(records.encode(group.key, torch.zeros(64, dtype=torch.uint8),
                                {"pack": PACK_VERSION, "members": [[items[0][0].digest, 0, 65]]}))
    with pytest.raises(records.RecordError):
        layout.decode(group, bad, [key for key, _, _ in items])
    assert isinstance(group, Group)


@pytest.mark.s3
@pytest.mark.serial
def test_a_put_of_packs_while_the_server_hangs_leaves_every_layer_unwritten(s3_bucket):
    tier = tier_of(s3_bucket, timeout_s=1.0)
    try:
        tier.put_many(chunk_items(b"\x03" * 8))
        items = chunk_items(b"\x01" * 8) + chunk_items(b"\x02" * 8)
        s3_bucket.server.pause()
        try:
            unwritten = tier.try_put_many(items)
        finally:
            s3_bucket.server.resume()
        assert unwritten is not None and unwritten.positions == tuple(range(2 * LAYERS))
        assert tier.counters.get("puts") == LAYERS
        wait_until("the tier back up", lambda: not tier.down)
        # a put of some layers of a pack that cannot be read now is not written: it would replace the pack
        s3_bucket.server.pause()
        try:
            unwritten = tier.try_put_many(chunk_items(b"\x03" * 8, seed=50, layers=[1]))
        finally:
            s3_bucket.server.resume()
        assert unwritten is not None and unwritten.positions == (0,)
        wait_until("the tier back up", lambda: not tier.down)
        got = tier.get_many(layer_keys(b"\x03" * 8))
        assert all(rec is not None and torch.equal(rec.tensor, tensor(layer)) for layer, rec in enumerate(got))
    finally:
        tier.close()
