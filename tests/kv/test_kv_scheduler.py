"""KVSchedulerSide planning on real vLLM `Request`s and a real disk store (no engine needed).

Only the scheduler output and the block table are stand-ins: plain objects with the fields vLLM 0.32's
scheduler fills. Everything the plan is computed from (block hashes, the store) is real.
"""

from __future__ import annotations

import random
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from vllm_tiercache.kvcache.groups import KVGroups
from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming, adapter_chunk_hash
from vllm_tiercache.kvcache.plan import TieredKVWorkerMetadata
from vllm_tiercache.kvcache.scheduler import KVSchedulerSide
from vllm_tiercache.shared.naming.keys import KVModelIdentity, kv_chunk_key
from vllm_tiercache.shared.naming.weights_identity import digest_directory
from vllm_tiercache.shared.store import build_store

BLOCK, CHUNK = 32, 128  # 4 blocks per chunk
IDENTITY = KVModelIdentity(
    model="tiny",
    dtype="bfloat16",
    num_layers=2,
    num_kv_heads=2,
    head_size=64,
    block_size=BLOCK,
    layout="paged-bhnc",
    tp_size=1,
    tp_rank=0,
)


def make_request(req_id: str, tokens: list[int], lora_request: LoRARequest | None = None) -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, hash_fn),
        lora_request=lora_request,
    )


class BlockTable:
    """Stand-in for vLLM's KVCacheManager.get_block_ids: request i owns blocks 1000*i ... in each of ``groups``
    KV cache groups (the same ids: vLLM's block ids are unique within a group only)."""

    def __init__(self, groups: int = 1) -> None:
        self.owner: dict[str, int] = {}
        self.groups = groups

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        base = 1000 * (self.owner.setdefault(req_id, len(self.owner)) + 1)
        return tuple(list(range(base, base + 64)) for _ in range(self.groups))


def step(new: list[tuple[str, int]], cached: list[tuple[str, int]], scheduled: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]
        ),
        num_scheduled_tokens=scheduled,
        finished_req_ids=set(),
    )


def make_side(tmp_path, kv_groups: KVGroups | None = None, **options: bool) -> KVSchedulerSide:
    """A scheduler side over a real disk store; `options` override the kv_both defaults; ``kv_groups``: the
    model's KV cache groups (default: one full-attention group of every layer)."""
    store = build_store({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "64MiB"}]})
    settings = {"can_load": True, "can_save": True, "save_partial_chunks": True, "save_decode": False, **options}
    naming = KVNaming(namespace="t", identities=(IDENTITY,), geometry=ChunkGeometry(BLOCK, CHUNK), hash_algo="sha256",
                      save_partial_chunks=settings.pop("save_partial_chunks"), kv_groups=kv_groups)
    scheduler = KVSchedulerSide(store=store, naming=naming, **settings)
    scheduler.bind_kv_cache_manager(BlockTable(len(naming.groups.groups)))  # type: ignore[arg-type]
    return scheduler


@pytest.fixture
def side(tmp_path):
    scheduler = make_side(tmp_path)
    yield scheduler
    scheduler.store.close()


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def store_chunk(side: KVSchedulerSide, chunk_hash: bytes, blocks: int) -> None:
    for layer in range(IDENTITY.num_layers):
        side.store.put(kv_chunk_key("t", IDENTITY, chunk_hash, layer), torch.zeros(blocks, 2, BLOCK, 128))
    side.store.flush()


def test_full_chunks_during_chunked_prefill_and_the_partial_one_only_at_the_end(side) -> None:
    request = make_request("a", tokens(330))  # 10 full blocks: chunks [0,4) [4,8) and partial [8,10)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, 0)
    first = side.build_connector_meta(step([("a", 0)], [], {"a": 200}))
    (plan,) = first.requests
    assert [len(s.block_ids) for s in plan.saves] == [4]  # blocks 0-3 are complete after 200 tokens
    assert plan.saves[0].chunk_hash == request.block_hashes[3] and plan.saves[0].block_ids == [1000, 1001, 1002, 1003]
    second = side.build_connector_meta(step([], [("a", 200)], {"a": 100}))
    assert [s.chunk_hash for s in second.requests[0].saves] == [request.block_hashes[7]]  # not yet the partial
    third = side.build_connector_meta(step([], [("a", 300)], {"a": 30}))  # prefill ends: the partial chunk
    assert [s.chunk_hash for s in third.requests[0].saves] == [request.block_hashes[9]]
    assert third.requests[0].saves[0].block_ids == [1008, 1009]
    decode = side.build_connector_meta(step([], [("a", 330)], {"a": 1}))
    assert decode.requests == []  # save_decode is off


def test_chunks_found_stored_are_passed_over_for_good(side) -> None:
    """A stored chunk between two missing ones is not saved again, the others are, and no later step
    looks at any of them: `saved_until` moves past every chunk considered, so a decode step's planning
    costs the same whatever the prompt's length (it scanned every chunk end before)."""
    request = make_request("s", tokens(330))  # chunks [0,4) [4,8) and the partial [8,10)
    store_chunk(side, request.block_hashes[7], 4)  # only the middle one
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)  # no prefix hit
    side.update_state_after_alloc(request, 0)
    (plan,) = side.build_connector_meta(step([("s", 0)], [], {"s": 330})).requests
    assert [s.chunk_hash for s in plan.saves] == [request.block_hashes[3], request.block_hashes[9]]
    # each save names the chunk before it (the records' parent, for prefix-aware eviction), stored or not
    assert [s.parent_hash for s in plan.saves] == [None, request.block_hashes[7]]
    assert side._requests["s"].saved_until == 10
    assert side._requests["s"].next_save_block == sys.maxsize  # save_decode is off: nothing more, ever
    for computed in range(330, 340):
        request.append_output_token_ids(7)
        assert side.build_connector_meta(step([], [("s", computed)], {"s": 1})).requests == []
    # A full hit: every chunk stored, none saved, and the request's state says so at once.
    hit = make_request("h", tokens(330))
    for end in (4, 8, 10):
        store_chunk(side, hit.block_hashes[end - 1], 4 if end % 4 == 0 else 2)
    assert side.get_num_new_matched_tokens(hit, 0) == (10 * BLOCK, False)
    side.update_state_after_alloc(hit, 10 * BLOCK)
    (plan,) = side.build_connector_meta(step([("h", 10 * BLOCK)], [], {"h": 330 - 10 * BLOCK})).requests
    assert len(plan.loads) == 3 and plan.saves == []
    assert side._requests["h"].saved_until == 10


def test_chunks_passed_over_as_stored_are_saved_after_a_lookup_finds_them_gone(side) -> None:
    """Preempted after a full hit, the request recomputes its prompt; if its chunks were evicted meanwhile,
    the new lookup finds them gone and the recompute saves them again (passing a chunk over as stored
    holds only until the next lookup)."""
    request = make_request("p", tokens(256))  # chunks [0,4) [4,8)
    for end in (4, 8):
        store_chunk(side, request.block_hashes[end - 1], 4)
    assert side.get_num_new_matched_tokens(request, 0) == (7 * BLOCK, False)
    side.update_state_after_alloc(request, 7 * BLOCK)
    (plan,) = side.build_connector_meta(step([("p", 7 * BLOCK)], [], {"p": BLOCK})).requests
    assert len(plan.loads) == 2 and plan.saves == []
    (disk,) = side.store.tiers
    assert disk.delete_stored(lambda record: True)[0] == 2 * IDENTITY.num_layers  # evicted while preempted
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)  # rescheduled from scratch
    side.update_state_after_alloc(request, 0)
    (plan,) = side.build_connector_meta(step([("p", 0)], [], {"p": 256})).requests
    assert [s.chunk_hash for s in plan.saves] == [request.block_hashes[3], request.block_hashes[7]]


def test_hit_stops_one_token_short_and_loads_only_beyond_local_hits(side) -> None:
    prompt = tokens(256)  # exactly 2 chunks
    request = make_request("b", prompt)
    store_chunk(side, request.block_hashes[3], 4)
    store_chunk(side, request.block_hashes[7], 4)
    # 255 usable tokens -> 7 blocks; vLLM already holds 2 blocks locally.
    assert side.get_num_new_matched_tokens(request, 64) == (5 * BLOCK, False)
    side.update_state_after_alloc(request, 5 * BLOCK)
    meta = side.build_connector_meta(step([("b", 224)], [], {"b": 32}))
    (plan,) = meta.requests
    assert [(load.chunk_start, load.first, load.end) for load in plan.loads] == [(0, 2, 4), (4, 4, 7)]
    assert plan.loads[1].chunk_hash == request.block_hashes[7] and plan.loads[1].source_slice == slice(0, 3)
    assert plan.saves == []  # both chunks were already stored


def test_a_missing_layer_or_rank_is_no_hit(side) -> None:
    request = make_request("c", tokens(200))
    side.store.put(kv_chunk_key("t", IDENTITY, request.block_hashes[3], 0), torch.zeros(4, 2, BLOCK, 128))
    side.store.flush()
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)


def test_residency_reports_make_worker_memory_hits_visible(side) -> None:
    request = make_request("d", tokens(200))
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_connector_output(TieredKVWorkerMetadata(added={request.block_hashes[3]}))
    assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
    side.update_connector_output(TieredKVWorkerMetadata(evicted={request.block_hashes[3]}))
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)


def test_tensor_parallel_reports_aggregate_to_what_every_rank_holds() -> None:
    a = TieredKVWorkerMetadata(added={b"x", b"y"}, evicted={b"p"})
    b = TieredKVWorkerMetadata(added={b"y"}, evicted={b"q"})
    merged = a.aggregate(b)
    assert merged.added == {b"y"} and merged.evicted == {b"p", b"q"}


def test_save_decode_saves_chunks_completed_while_decoding(tmp_path) -> None:
    side = make_side(tmp_path, can_load=False, save_partial_chunks=False, save_decode=True)
    request = make_request("e", tokens(120))
    side.get_num_new_matched_tokens(request, 0)
    assert side.build_connector_meta(step([("e", 0)], [], {"e": 120})).requests == []  # 3 blocks, no chunk
    for _ in range(8):
        request.append_output_token_ids(7)
    meta = side.build_connector_meta(step([], [("e", 120)], {"e": 8}))
    assert [s.chunk_hash for s in meta.requests[0].saves] == [request.block_hashes[3]]
    side.store.close()


def test_a_recompute_past_the_prompt_saves_each_chunk_once(tmp_path) -> None:
    """A request recomputed with its output (after a preemption or a weights reset) completes, in one step,
    the prompt's partial chunk and a full chunk past it: both saved once (the partial one, planned last,
    once moved the saved mark back and the full chunk was saved again on the next step)."""
    side = make_side(tmp_path, save_decode=True)
    request = make_request("r", tokens(330))  # 10 prompt blocks: chunks [0,4) [4,8), partial [8,10)
    for _ in range(60):
        request.append_output_token_ids(7)  # 390 tokens: 12 full blocks, a full chunk [8,12) past the prompt
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, 0)
    (plan,) = side.build_connector_meta(step([("r", 0)], [], {"r": 390})).requests
    assert sorted(s.chunk_hash for s in plan.saves) == sorted(request.block_hashes[end - 1] for end in (4, 8, 10, 12))
    request.append_output_token_ids(7)
    assert side.build_connector_meta(step([], [("r", 390)], {"r": 1})).requests == []
    side.store.close()


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    with pytest.raises(ValueError, match="chunk_size=100 must be a positive multiple"):
        ChunkGeometry(32, 100)


def test_hit_sources_split_memory_residents_from_disk(side) -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    request = make_request("f", tokens(300))  # chunks [0,4) [4,8) [8,9)
    side.update_connector_output(TieredKVWorkerMetadata(added={request.block_hashes[3]}))
    store_chunk(side, request.block_hashes[7], 4)
    assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
    side.update_state_after_alloc(request, 8 * BLOCK)
    assert side.hit_sources(request, 8 * BLOCK) == {CacheHitSource.HOST: 4 * BLOCK, CacheHitSource.DISK: 4 * BLOCK}


def test_a_longer_prompt_reaches_the_stored_partial_chunk_of_its_prefix(side) -> None:
    """RAG: a precomputed document (its last chunk partial) followed by a question must hit all of it."""
    document = tokens(200, seed=7)  # 6 full blocks: chunk [0,4) and partial chunk [4,6)
    produced = make_request("doc", document)
    store_chunk(side, produced.block_hashes[3], 4)
    store_chunk(side, produced.block_hashes[5], 2)
    query = make_request("q", document + tokens(90, seed=8))  # 9 full blocks: chunks end at 4, 8, 9
    assert query.block_hashes[:6] == produced.block_hashes
    assert side.get_num_new_matched_tokens(query, 0) == (6 * BLOCK, False)
    side.update_state_after_alloc(query, 6 * BLOCK)
    (plan,) = side.build_connector_meta(step([("q", 0)], [], {"q": 290})).requests
    assert [(load.chunk_hash, load.chunk_start, load.first, load.end) for load in plan.loads] == [
        (query.block_hashes[3], 0, 0, 4),
        (query.block_hashes[5], 4, 4, 6),
    ]
    # The query's own chunks [4,8) and [8,9) were not stored: they are saved, the stored one is not.
    assert [s.chunk_hash for s in plan.saves] == [query.block_hashes[7], query.block_hashes[8]]


def test_a_request_the_hook_calls_uncacheable_is_never_looked_up_nor_saved(tmp_path) -> None:
    """`request_cacheable` (the multimodal-identifier hook): False keeps the request out of the store both ways."""
    asked: list[str] = []

    def cacheable(request: Request) -> bool:
        asked.append(request.request_id)
        return request.request_id != "private"

    side = make_side(tmp_path, request_cacheable=cacheable)  # type: ignore[arg-type]
    prompt = tokens(300)
    private, public = make_request("private", prompt), make_request("public", prompt)
    store_chunk(side, private.block_hashes[3], 4)
    assert side.get_num_new_matched_tokens(private, 0) == (0, False)  # stored, but never looked up
    side.update_state_after_alloc(private, 0)
    meta = side.build_connector_meta(step([("private", 0)], [], {"private": 300}))
    assert meta.requests == []  # and nothing saved
    assert side.get_num_new_matched_tokens(public, 0) == (4 * BLOCK, False)
    side.update_state_after_alloc(public, 4 * BLOCK)
    (plan,) = side.build_connector_meta(step([("public", 128)], [], {"public": 172})).requests
    assert plan.loads and plan.saves
    assert asked == ["private", "public"]  # asked once per request
    side.store.close()


def test_update_state_after_alloc_first_still_honours_the_hook(tmp_path) -> None:
    side = make_side(tmp_path, request_cacheable=lambda request: False)  # type: ignore[arg-type]
    request = make_request("x", tokens(300))
    side.update_state_after_alloc(request, 0)
    assert side.build_connector_meta(step([("x", 0)], [], {"x": 300})).requests == []
    side.store.close()


def test_only_publishable_blocks_are_saved(side) -> None:
    """Newer vLLM marks how many block hashes may be published (EAGLE prefix-cache hashing)."""
    request = make_request("p", tokens(330))  # 10 full blocks: chunks [0,4) [4,8) and partial [8,10)
    request.num_publishable_block_hashes = 5  # type: ignore[attr-defined]
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, 0)
    (plan,) = side.build_connector_meta(step([("p", 0)], [], {"p": 330})).requests
    assert [s.chunk_hash for s in plan.saves] == [request.block_hashes[3]]  # not [4,8), not the partial one


def test_eagle_keeps_the_trailing_decode_chunk_until_the_next_one_completes(tmp_path) -> None:
    side = make_side(tmp_path, can_load=False, save_partial_chunks=False, save_decode=True, volatile_decode_tail=True)
    request = make_request("g", tokens(120))
    side.get_num_new_matched_tokens(request, 0)
    assert side.build_connector_meta(step([("g", 0)], [], {"g": 120})).requests == []
    for _ in range(8):
        request.append_output_token_ids(7)
    assert side.build_connector_meta(step([], [("g", 120)], {"g": 8})).requests == []  # [0,4) is the volatile tail
    for _ in range(128):
        request.append_output_token_ids(7)
    meta = side.build_connector_meta(step([], [("g", 128)], {"g": 128}))
    assert [s.chunk_hash for s in meta.requests[0].saves] == [request.block_hashes[3]]  # [4,8) now the tail
    side.store.close()


def test_a_lora_requests_chunks_are_named_by_the_adapters_files(side, tmp_path, caplog) -> None:
    """vLLM hashes a LoRA request's blocks with the adapter's name and path only; the chunk names mix in a
    digest of the adapter's files, so an adapter rewritten in place never meets the old one's KV."""
    side.adapter_wait_s = 10.0  # this test is about naming, not about a slow digest
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-1")
    prompt = tokens(300)
    first = make_request("lora-1", prompt, LoRARequest("a", 1, str(adapter)))
    assert side.get_num_new_matched_tokens(first, 0) == (0, False)
    side.update_state_after_alloc(first, 0)
    (plan,) = side.build_connector_meta(step([("lora-1", 0)], [], {"lora-1": 300})).requests
    digest, _ = digest_directory(adapter)
    named = adapter_chunk_hash(first.block_hashes[3], digest)
    assert plan.saves[0].chunk_hash == named != first.block_hashes[3]
    store_chunk(side, named, 4)
    again = make_request("lora-2", prompt, LoRARequest("a", 1, str(adapter)))
    assert side.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, False)

    # The same name and path after the files changed, loaded again (vLLM gives a reloaded adapter a new
    # id; a restart starts with no digest remembered).
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-2")
    retrained = make_request("lora-3", prompt, LoRARequest("a", 3, str(adapter)))
    assert retrained.block_hashes[3] == first.block_hashes[3]  # vLLM's hash cannot tell them apart
    assert side.get_num_new_matched_tokens(retrained, 0) == (0, False)

    # An adapter this process cannot read as a directory: kept out of the store both ways, one warning.
    remote = make_request("remote", prompt, LoRARequest("hub", 2, "org/some-adapter-on-the-hub"))
    store_chunk(side, remote.block_hashes[3], 4)
    with caplog.at_level("WARNING"):
        assert side.get_num_new_matched_tokens(remote, 0) == (0, False)
    side.update_state_after_alloc(remote, 0)
    assert side.build_connector_meta(step([("remote", 0)], [], {"remote": 300})).requests == []
    assert "cannot be named by its files" in caplog.text


def test_a_slow_adapter_digest_never_stalls_the_scheduler(side, tmp_path, monkeypatch) -> None:
    """The digest runs on a background thread: a request waits at most `adapter_wait_s`, is computed without
    the cache meanwhile, and a later request of the adapter is cached once the digest is ready."""
    import vllm_tiercache.kvcache.adapters as adapters

    release = threading.Event()
    real = adapters.digest_directory
    digested: list[str] = []

    def slow(directory, cache_dir=None):
        release.wait(60)  # until the test lets it go (a minute: only ends a test that would hang)
        digested.append(str(directory))
        return real(directory, cache_dir)

    monkeypatch.setattr(adapters, "digest_directory", slow)
    adapter = tmp_path / "slow-adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    side.adapter_wait_s = 0.05
    prompt = tokens(300)
    first = make_request("slow-1", prompt, LoRARequest("s", 7, str(adapter)))
    assert side.get_num_new_matched_tokens(first, 0) == (0, False)
    assert digested == []  # it returned with the digest still held: it did not wait for it
    side.update_state_after_alloc(first, 0)
    assert side.build_connector_meta(step([("slow-1", 0)], [], {"slow-1": 300})).requests == []  # not saved
    release.set()
    side.adapter_wait_s = 60.0  # returns once the digest is ready; a loaded machine may take seconds
    later = make_request("slow-2", prompt, LoRARequest("s", 7, str(adapter)))
    side.get_num_new_matched_tokens(later, 0)
    side.update_state_after_alloc(later, 0)
    (plan,) = side.build_connector_meta(step([("slow-2", 0)], [], {"slow-2": 300})).requests
    assert plan.saves and plan.saves[0].chunk_hash != later.block_hashes[3]


def test_vllm_extends_a_requests_block_hashes_in_place() -> None:
    """The scheduler's `RequestNames` keeps the request's ``block_hashes`` list and names the chunks that
    decode completes from it later: vLLM must extend that very list as tokens arrive. A vLLM that replaced
    the list would leave those names stale; this fails first."""
    request = make_request("in-place", list(range(2 * BLOCK)))
    hashes = request.block_hashes
    assert len(hashes) == 2
    request.append_output_token_ids(list(range(BLOCK)))
    assert request.block_hashes is hashes
    assert len(hashes) == 3
