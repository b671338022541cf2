"""vllm_tiercache.shared.naming.hashing must give the engine's own block hashes, computed by vLLM 0.32's own code.

vLLM is imported unconditionally: without it these tests must fail, not skip, because equality with the
engine is the whole point of the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request

from tests.support.hashing_helpers import chunk_hashes, extra_keys_of
from vllm_tiercache.kvcache.naming import ChunkGeometry
from vllm_tiercache.shared.config import ConfigError
from vllm_tiercache.shared.naming import hashing as th
from vllm_tiercache.shared.naming.hashing import (
    HASH_ALGOS,
    BlockExtraKeys,
    MMInput,
    UnstableHashSeedError,
    assert_engine_seed_matches,
    block_hashes,
    check_seed_is_stable,
    extra_keys_for_block,
    hash_fn,
    none_hash,
)

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16

#: A seed setting under which each algorithm is reproducible across processes (None = env var unset).
STABLE_SEEDS: list[tuple[str, str | None]] = [
    ("sha256", None),
    ("sha256", "0"),
    ("sha256_cbor", None),
    ("sha256_cbor", "4242"),
    ("xxhash", "0"),
    ("xxhash", "12345"),
    ("xxhash_cbor", "7"),
    ("xxhash_cbor", ""),
]


@contextmanager
def env_seed(value: str | None) -> Iterator[None]:
    """Set or unset PYTHONHASHSEED for this process only (hypothesis cannot use monkeypatch)."""
    old = os.environ.get("PYTHONHASHSEED")
    if value is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = old


@contextmanager
def engine_seeded(algo: str, seed: str | None) -> Iterator[Any]:
    """Run vLLM's own init_none_hash as EngineCore does, restoring its module globals afterwards."""
    had = hasattr(kcu, "NONE_HASH")
    old_hash, old_seed = getattr(kcu, "NONE_HASH", None), kcu._NONE_HASH_SEED
    with env_seed(seed):
        fn = get_hash_fn_by_name(algo)
        kcu.init_none_hash(fn)
        try:
            yield fn
        finally:
            kcu._NONE_HASH_SEED = old_seed
            if had:
                kcu.NONE_HASH = old_hash
            else:
                del kcu.NONE_HASH


def engine_chain(fn: Any, tokens: list[int], block_size: int, extras: Any = None) -> list[bytes]:
    """The chain built with vLLM's hash_block_tokens (uses the live NONE_HASH)."""
    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // block_size):
        s, e = i * block_size, (i + 1) * block_size
        parent = kcu.hash_block_tokens(fn, parent, tokens[s:e], extras(s, e) if extras else None)
        out.append(parent)
    return out


# ---------------------------------------------------------------------------------------------- hash fns

SAMPLE_OBJECTS: list[Any] = [
    "vllm-none-hash",
    "",
    (b"\x00" * 32, (1, 2, 3), None),
    (b"\xff" * 16, tuple(range(64)), (("lora", "a", "/p"), ("mm", "h" * 64, -3), ("cache_salt", "s"))),
    (b"x", (2**40, 0, 151_643), (("mm", "same", 0), ("mm", "same", 5))),
]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hash_fn_is_byte_identical_to_vllm(algo: str) -> None:
    ours, theirs = hash_fn(algo), get_hash_fn_by_name(algo)
    for obj in SAMPLE_OBJECTS:
        assert ours(obj) == theirs(obj)
    assert len(ours("x")) == (32 if algo.startswith("sha256") else 16)


def test_unknown_algo_is_rejected() -> None:
    with pytest.raises(ValueError, match="Unsupported"):
        hash_fn("md5")
    with pytest.raises(ValueError):
        none_hash("blake3")


# ---------------------------------------------------------------------------------------------- seeds


@pytest.mark.parametrize(("algo", "seed"), STABLE_SEEDS)
def test_none_hash_equals_init_none_hash(algo: str, seed: str | None) -> None:
    with engine_seeded(algo, seed):
        assert none_hash(algo) == kcu.NONE_HASH
        assert assert_engine_seed_matches(algo) is True
    expected_seed = th.DEFAULT_NONE_HASH_SEED if seed is None else seed
    with env_seed(seed):
        assert (
            th.none_hash_seed(algo) == expected_seed == kcu.resolve_none_hash_seed(get_hash_fn_by_name(algo))
        )


def test_crypto_seed_is_the_fixed_vllm_default() -> None:
    assert th.DEFAULT_NONE_HASH_SEED == kcu.DEFAULT_NONE_HASH_SEED
    with env_seed(None):
        assert none_hash("sha256") == get_hash_fn_by_name("sha256")("vllm-none-hash")
        check_seed_is_stable("sha256")
        check_seed_is_stable("sha256_cbor")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_random_per_process_seed_is_refused(algo: str) -> None:
    with env_seed(None):
        # The premise, from vLLM itself: unseeded xxhash draws a new seed every time.
        fn = get_hash_fn_by_name(algo)
        assert kcu.resolve_none_hash_seed(fn) != kcu.resolve_none_hash_seed(fn)
        with pytest.raises(UnstableHashSeedError, match="PYTHONHASHSEED=<any fixed integer>"):
            check_seed_is_stable(algo)
        with pytest.raises(UnstableHashSeedError, match=f"prefix_caching_hash_algo={algo} without"):
            none_hash(algo)
        with pytest.raises(UnstableHashSeedError):
            block_hashes(list(range(32)), BLOCK, algo)


def test_engine_mismatch_is_explained() -> None:
    # Engine initialised without PYTHONHASHSEED (random seed), tiercache process sees one set later.
    with engine_seeded("xxhash", None), env_seed("0"):
        with pytest.raises(UnstableHashSeedError, match="random per-process seed"):
            assert_engine_seed_matches("xxhash")
    # Engine configured with another algorithm.
    with engine_seeded("sha256_cbor", None):
        with pytest.raises(UnstableHashSeedError, match="prefix_caching_hash_algo=sha256_cbor, not sha256"):
            assert_engine_seed_matches("sha256")
    # Engine seeded from a different PYTHONHASHSEED.
    with engine_seeded("sha256", "1"), env_seed("2"):
        with pytest.raises(UnstableHashSeedError, match="'1' but this process would use '2'"):
            assert_engine_seed_matches("sha256")


def test_nothing_to_compare_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(kcu, "NONE_HASH", raising=False)
    assert assert_engine_seed_matches("sha256") is False


# ---------------------------------------------------------------------------------------------- chains


@pytest.mark.parametrize(("algo", "seed"), STABLE_SEEDS)
def test_chain_equals_hash_block_tokens(algo: str, seed: str | None) -> None:
    tokens = [(i * 7919) % 32_000 for i in range(5 * BLOCK + 3)]
    with engine_seeded(algo, seed) as fn:
        assert block_hashes(tokens, BLOCK, algo) == engine_chain(fn, tokens, BLOCK)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=200),
    block_size=st.sampled_from([1, 4, 16, 32]),
    seeded=st.sampled_from(STABLE_SEEDS),
    salt=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
)
def test_property_random_tokens_match_vllm(
    tokens: list[int], block_size: int, seeded: tuple[str, str | None], salt: str | None
) -> None:
    algo, seed = seeded
    extras = BlockExtraKeys(cache_salt=salt)
    with engine_seeded(algo, seed) as fn:
        ours = block_hashes(tokens, block_size, algo, extra_keys_per_block=extras)
        assert ours == engine_chain(fn, tokens, block_size, extras)
        assert len(ours) == len(tokens) // block_size
        # A prefix hashes to a prefix of the chain, and continuing from a parent equals hashing it all.
        cut = (len(ours) // 2) * block_size
        assert (
            block_hashes(tokens[:cut], block_size, algo, extra_keys_per_block=extras)
            == ours[: cut // block_size]
        )
        if 0 < cut:
            tail = block_hashes(
                tokens[cut:],
                block_size,
                algo,
                extra_keys_per_block=extras,
                parent=ours[cut // block_size - 1],
                start_token=cut,
            )
            assert tail == ours[cut // block_size :]


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=1000), min_size=BLOCK, max_size=120),
    pos=st.integers(min_value=0, max_value=119),
    delta=st.integers(min_value=1, max_value=5),
)
def test_property_token_change_changes_its_block_and_all_later(
    tokens: list[int], pos: int, delta: int
) -> None:
    pos %= len(tokens)
    changed = list(tokens)
    changed[pos] += delta
    with env_seed(None):
        a, b = block_hashes(tokens, BLOCK, "sha256"), block_hashes(changed, BLOCK, "sha256")
    first = pos // BLOCK
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))


def test_continuation_without_position_is_rejected() -> None:
    with env_seed(None), pytest.raises(ValueError, match="start_token"):
        block_hashes(
            [1] * 32, BLOCK, "sha256", parent=b"p", extra_keys_per_block=BlockExtraKeys(cache_salt="s")
        )


def test_numpy_like_tokens_hash_like_python_ints() -> None:
    import torch

    tokens = list(range(3 * BLOCK))
    with env_seed(None):
        assert block_hashes(torch.tensor(tokens), BLOCK, "sha256") == block_hashes(tokens, BLOCK, "sha256")


# ---------------------------------------------------------------------------------------------- requests

PLACEHOLDER = 151_655


def _mm_layout() -> list[tuple[int, int, str]]:
    """Placeholders exercising every branch of vLLM's mm walk (BLOCK=16).

    A spans blocks 0-2; B and C both start in block 2 (three items in one block) and C spills into block
    3; C has B's identifier as a *distinct* equal string (what IPC produces); D starts exactly on a block
    boundary and fills two blocks; E starts mid-block in the generated tail.
    """
    dup = "".join(["img-", "dup"])
    dup2 = "".join(["img-", "dup"])
    return [
        (5, 40, "lora1:" + "a" * 64),
        (45, 2, dup),
        (47, 10, dup2),
        (64, 32, "d" * 64),
        (110, 20, "e" * 64),
    ]


def _prompt(layout: list[tuple[int, int, str]], n: int) -> list[int]:
    tokens = [1000 + (i % 97) for i in range(n)]
    for off, length, _ in layout:
        tokens[off : off + length] = [PLACEHOLDER] * length
    return tokens


def make_request(
    algo: str,
    tokens: list[int],
    layout: list[tuple[int, int, str]],
    lora: tuple[str, str] | None,
    salt: str | None,
) -> Request:
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=off, length=ln),
            mm_hash=ident.split(":")[-1],
        )
        for off, ln, ident in layout
    ]
    return Request(
        request_id="r",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        mm_features=features,
        lora_request=None
        if lora is None
        else LoRARequest(lora_name=lora[0], lora_int_id=1, lora_path=lora[1]),
        cache_salt=salt,
        block_hasher=kcu.get_request_block_hasher(BLOCK, get_hash_fn_by_name(algo)),
    )


REQUEST_CASES = [
    pytest.param(True, ("lora1", "/adapters/lora1"), "tenant-42", id="mm+lora+salt"),
    pytest.param(True, None, None, id="mm-only"),
    pytest.param(False, ("l", "/a/l"), None, id="lora-only"),
    pytest.param(False, None, "salt", id="salt-only"),
    pytest.param(False, None, None, id="plain"),
]


@pytest.mark.parametrize(("algo", "seed"), [s for s in STABLE_SEEDS if s[1] != ""])
@pytest.mark.parametrize(("with_mm", "lora", "salt"), REQUEST_CASES)
def test_request_block_hashes_equal_engine(
    algo: str, seed: str | None, with_mm: bool, lora: tuple[str, str] | None, salt: str | None
) -> None:
    layout = _mm_layout()[:4] if with_mm else []
    tokens = _prompt(layout, 100)  # 6 full blocks + 4 tokens
    with engine_seeded(algo, seed):
        req = make_request(algo, tokens, layout, lora, salt)
        assert len(req.block_hashes) == 6

        # Built independently of the Request object, as an offline precompute job would.
        extras = BlockExtraKeys(
            mm_inputs=tuple(MMInput(o, n, "".join(list(i))) for o, n, i in layout),
            lora_name=None if lora is None else lora[0],
            lora_path=None if lora is None else lora[1],
            cache_salt=salt,
        )
        assert block_hashes(tokens, BLOCK, algo, extra_keys_per_block=extras) == req.block_hashes
        assert block_hashes(tokens, BLOCK, algo, extra_keys_per_block=extra_keys_of(req)) == (
            req.block_hashes
        )
        # The extra keys themselves are vLLM's tuples, block by block.
        for i in range(6):
            s, e = i * BLOCK, (i + 1) * BLOCK
            assert extras(s, e) == kcu.generate_block_hash_extra_keys(req, s, e, 0)[0]

        # Decoding appends blocks incrementally (vLLM resumes its mm cursor mid-prompt); still equal.
        req.append_output_token_ids([7] * 30)
        full = list(req.all_token_ids)
        assert len(req.block_hashes) == len(full) // BLOCK == 8
        assert block_hashes(full, BLOCK, algo, extra_keys_per_block=extras) == req.block_hashes


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_request_with_late_image_incremental(algo: str) -> None:
    """Images after the first hashed blocks: vLLM's hasher starts mid-list via get_mm_features_in_window."""
    layout = _mm_layout()
    tokens = _prompt(layout, 140)
    with engine_seeded(algo, "3"):
        req = make_request(algo, tokens[:50], layout, ("lora1", "/p"), "salt")
        for i in range(50, 140, 9):
            req.append_output_token_ids(tokens[i : i + 9])
        assert len(req.block_hashes) == 140 // BLOCK
        extras = extra_keys_of(req)
        assert block_hashes(tokens, BLOCK, algo, extra_keys_per_block=extras) == req.block_hashes


def test_extra_key_tuple_format() -> None:
    mm = [(5, 40, "h1"), (45, 2, "h2")]
    assert extra_keys_for_block(32, 48, mm_inputs=mm, lora_name="n", lora_path="/p", cache_salt="s") == (
        ("lora", "n", "/p"),
        ("mm", "h1", -27),
        ("mm", "h2", 13),
    )
    assert extra_keys_for_block(0, 16, mm_inputs=mm, cache_salt="s") == (("mm", "h1", 5), ("cache_salt", "s"))
    assert extra_keys_for_block(0, 16, cache_salt="") is None
    assert extra_keys_for_block(48, 64, mm_inputs=mm) is None
    assert extra_keys_for_block(45, 61, mm_inputs=[(45, 0, "empty")]) is None


def test_lora_without_path_is_rejected() -> None:
    with pytest.raises(ValueError, match="lora_path"):
        BlockExtraKeys(lora_name="l1")
    with pytest.raises(ValueError, match="lora_path"):
        extra_keys_for_block(0, 16, lora_name="l1")


def test_same_identifier_object_twice_hashes_like_distinct_engine_strings() -> None:
    ident = "x" * 64  # the very same object twice, as a caller might pass it
    keys = extra_keys_for_block(0, 16, mm_inputs=[(0, 4, ident), (4, 4, ident)])
    assert keys is not None and keys[0][1] == keys[1][1] and keys[0][1] is not keys[1][1]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_salt_lora_and_image_change_hashes(algo: str) -> None:
    layout = [(5, 40, "a" * 64)]
    tokens = _prompt(layout, 64)
    with env_seed("9"):
        base = block_hashes(tokens, BLOCK, algo, extra_keys_per_block=BlockExtraKeys(mm_inputs=tuple(layout)))

        def with_(**kw: Any) -> list[bytes]:
            args: dict[str, Any] = {"mm_inputs": tuple(layout), **kw}
            return block_hashes(tokens, BLOCK, algo, extra_keys_per_block=BlockExtraKeys(**args))

        for variant in (
            with_(cache_salt="t1"),
            with_(lora_name="l1", lora_path="/p"),
            with_(lora_name="l1", lora_path="/other"),
            with_(mm_inputs=((5, 40, "b" * 64),)),
            with_(mm_inputs=((6, 39, "a" * 64),)),
        ):
            assert variant[0] != base[0] and all(x != y for x, y in zip(variant, base, strict=True))
        assert with_(cache_salt="t1") != with_(cache_salt="t2")
        assert with_(lora_name="l1", lora_path="/p") != with_(lora_name="l2", lora_path="/p")
        assert with_(lora_name="l1", lora_path="/p") != with_(lora_name="l1", lora_path="/q")


# ---------------------------------------------------------------------------------------------- chunks


def chunk_boundaries(num_full_blocks: int, blocks_per_chunk: int) -> list[int]:
    """The chunk ends of the connector's geometry (`ChunkGeometry.chunk_ends`), 16-token blocks."""
    return ChunkGeometry(16, 16 * blocks_per_chunk).chunk_ends(num_full_blocks)


def test_chunk_boundaries() -> None:
    assert chunk_boundaries(10, 4) == [4, 8, 10]
    assert chunk_boundaries(8, 4) == [4, 8]
    assert chunk_boundaries(3, 4) == [3]
    assert chunk_boundaries(0, 4) == []
    assert chunk_boundaries(5, 1) == [1, 2, 3, 4, 5]
    with pytest.raises(ConfigError):
        chunk_boundaries(5, 0)
    with pytest.raises(ValueError):
        chunk_boundaries(-1, 2)


@given(n=st.integers(min_value=0, max_value=300), per=st.integers(min_value=1, max_value=40))
def test_property_chunks_partition_blocks(n: int, per: int) -> None:
    ends = chunk_boundaries(n, per)
    starts = [0, *ends[:-1]] if ends else []
    assert sum(e - s for s, e in zip(starts, ends, strict=True)) == n
    assert all(0 < e - s <= per for s, e in zip(starts, ends, strict=True))
    assert all(e - s == per for s, e in zip(starts[:-1], ends[:-1], strict=True))


def test_chunk_hashes_reuse_request_block_hashes() -> None:
    with engine_seeded("sha256", None):
        req = make_request("sha256", _prompt([], 16 * 10 + 5), [], None, None)
        hashes = list(req.block_hashes)
    assert chunk_hashes(hashes, 4) == [hashes[3], hashes[7], hashes[9]]
    assert chunk_hashes([], 4) == []


# ---------------------------------------------------------------------------------------------- processes

_CHILD = """
import json, sys
from vllm_tiercache.shared.naming.hashing import HASH_ALGOS, BlockExtraKeys, block_hashes
extras = BlockExtraKeys(mm_inputs=((5, 40, "lora1:" + "a" * 64),), lora_name="lora1", lora_path="/p",
                        cache_salt="salt")
tokens = [1000 + (i % 97) for i in range(100)]
algos = sys.argv[1].split(",")
out = {a: [h.hex() for h in block_hashes(tokens, 16, a, extra_keys_per_block=extras)] for a in algos}
print(json.dumps(out))
"""


def _child(algos: list[str], seed: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = str(REPO)
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    return subprocess.run(
        [sys.executable, "-c", _CHILD, ",".join(algos)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_two_processes_compute_the_same_hashes() -> None:
    extras = BlockExtraKeys(
        mm_inputs=((5, 40, "lora1:" + "a" * 64),), lora_name="lora1", lora_path="/p", cache_salt="salt"
    )
    tokens = [1000 + (i % 97) for i in range(100)]
    for seed, algos in (("31337", list(HASH_ALGOS)), (None, ["sha256", "sha256_cbor"])):
        runs = [_child(algos, seed) for _ in range(2)]
        for r in runs:
            assert r.returncode == 0, r.stderr
        a, b = (json.loads(r.stdout) for r in runs)
        assert a == b
        with env_seed(seed):
            for algo in algos:
                here = block_hashes(tokens, BLOCK, algo, extra_keys_per_block=extras)
                assert a[algo] == [h.hex() for h in here]
                with engine_seeded(algo, seed):  # and the engine agrees
                    assert (
                        a[algo][0]
                        == kcu.hash_block_tokens(
                            get_hash_fn_by_name(algo), None, tokens[:BLOCK], extras(0, BLOCK)
                        ).hex()
                    )


def test_process_without_pythonhashseed_refuses_xxhash() -> None:
    r = _child(["xxhash"], None)
    assert r.returncode != 0
    assert "UnstableHashSeedError" in r.stderr and "PYTHONHASHSEED" in r.stderr
