"""Prefix-chain block hashing that reproduces vLLM 0.32's ``request.block_hashes`` bit for bit.

Why a re-implementation instead of importing vLLM: precompute jobs, the CLI and offline tools must derive
the very same cache keys the engine derives, without starting (or even importing) an engine. Everything
here mirrors ``vllm/utils/hashing.py`` and ``vllm/v1/core/kv_cache_utils.py`` of vLLM 0.32:

* the four hash functions (``get_hash_fn_by_name``): pickle (protocol ``HIGHEST_PROTOCOL``) or canonical
  CBOR, then SHA-256 or XXH3-128;
* the chain seed ``NONE_HASH = hash_fn(seed)`` (``init_none_hash``), where ``seed`` is ``$PYTHONHASHSEED``
  when that variable is set (to anything, even ``""``), otherwise the fixed string ``"vllm-none-hash"`` for
  sha256/sha256_cbor and 32 random bytes (hex) *per process* for xxhash/xxhash_cbor;
* each full block hashes ``(parent_hash or NONE_HASH, tuple(block_tokens), extra_keys)``;
* ``extra_keys`` is ``None`` or a tuple of tagged tuples, in this order: ``("lora", lora_name, lora_path)``
  on every block of a LoRA request, one ``("mm", identifier, mm_offset - block_start)`` per multimodal
  item overlapping the block (identifier = the full feature identifier, LoRA-prefixed when vLLM made it
  so), ``("cache_salt", salt)`` on the block starting at token 0 only (and only for a non-empty salt).

Pickle is used only to *serialise for hashing* (as vLLM does); nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeAlias

import cbor2

try:
    import xxhash as _xxh

    if not hasattr(_xxh, "xxh3_128_digest"):  # same guard as vLLM: too old to have XXH3-128
        _xxh = None  # type: ignore[assignment]
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    _xxh = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "HASH_ALGOS",
    "BlockExtraKeys",
    "ExtraKeys",
    "ExtraKeysSource",
    "HashAlgo",
    "MMInput",
    "UnstableHashSeedError",
    "assert_engine_seed_matches",
    "block_hashes",
    "check_seed_is_stable",
    "extra_keys_for_block",
    "hash_block",
    "hash_fn",
    "none_hash",
    "none_hash_seed",
]

HashAlgo: TypeAlias = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]

#: The values vLLM accepts for ``--prefix-caching-hash-algo`` (``CacheConfig.prefix_caching_hash_algo``).
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

#: vLLM 0.32's ``DEFAULT_NONE_HASH_SEED``: the seed of cryptographic algorithms when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

#: Algorithms vLLM seeds randomly per process when PYTHONHASHSEED is unset (not collision resistant).
_NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})

#: The extra keys of one block, exactly as vLLM passes them to ``hash_block_tokens``.
ExtraKeys: TypeAlias = "tuple[Any, ...] | None"

#: What ``block_hashes`` accepts for extra keys: a function of ``(start_token, end_token)`` or one entry
#: per block (indexed from the first block hashed by that call).
ExtraKeysSource: TypeAlias = "Callable[[int, int], tuple[Any, ...] | None] | Sequence[tuple[Any, ...] | None]"

_UNSTABLE_MESSAGE = (
    "prefix_caching_hash_algo={algo} without PYTHONHASHSEED gives every process a random seed, so no other "
    "process (or restart) can ever hit this cache. Set PYTHONHASHSEED=<any fixed integer> in the environment "
    "of every vLLM and tiercache process, or use sha256/sha256_cbor"
)


class UnstableHashSeedError(RuntimeError):
    """The chain seed is (or would be) different in another process, so a shared cache can never hit."""


# --------------------------------------------------------------------------------------------------------
# Hash functions (vllm/utils/hashing.py)
# --------------------------------------------------------------------------------------------------------


def _xxh3_128(data: bytes) -> bytes:
    if _xxh is None:
        raise ModuleNotFoundError("xxhash>=3 (with xxh3_128_digest) is required for the xxhash algorithms")
    return _xxh.xxh3_128_digest(data)


def _sha256(obj: Any) -> bytes:
    """vLLM ``sha256``: pickle with the highest protocol, then SHA-256."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    """vLLM ``sha256_cbor``: canonical CBOR (language independent), then SHA-256."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    """vLLM ``xxhash``: pickle with the highest protocol, then XXH3-128."""
    return _xxh3_128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    """vLLM ``xxhash_cbor``: canonical CBOR, then XXH3-128."""
    return _xxh3_128(cbor2.dumps(obj, canonical=True))


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


def hash_fn(name: str) -> Callable[[Any], bytes]:
    """Our twin of vLLM's ``get_hash_fn_by_name(name)``: same bytes out for the same object in.

    Raises ``ValueError`` for an unknown name (as vLLM does), listing the accepted ones.
    """
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(f"Unsupported hash function: {name!r} (expected one of {HASH_ALGOS})") from None


def _check_algo(algo: str) -> None:
    if algo not in _HASH_FNS:
        raise ValueError(f"Unsupported prefix caching hash algorithm {algo!r}; expected one of {HASH_ALGOS}")


# --------------------------------------------------------------------------------------------------------
# The chain seed (init_none_hash)
# --------------------------------------------------------------------------------------------------------


def check_seed_is_stable(algo: str) -> None:
    """Refuse an algorithm whose seed vLLM would draw at random in this environment.

    vLLM 0.32 seeds xxhash/xxhash_cbor from ``os.urandom`` unless PYTHONHASHSEED is set (any value counts,
    exactly as ``os.getenv(...) is not None``), which makes every cached block unreachable from any other
    process. Failing loudly here beats a cache that silently never hits.
    """
    _check_algo(algo)
    if algo in _NON_CRYPTO_ALGOS and os.getenv("PYTHONHASHSEED") is None:
        raise UnstableHashSeedError(_UNSTABLE_MESSAGE.format(algo=algo))


def none_hash_seed(algo: str) -> str:
    """The string vLLM's ``resolve_none_hash_seed`` returns here, or raise if it would be random."""
    check_seed_is_stable(algo)
    env_seed = os.getenv("PYTHONHASHSEED")
    return env_seed if env_seed is not None else DEFAULT_NONE_HASH_SEED


def none_hash(algo: str) -> bytes:
    """vLLM's ``NONE_HASH`` for ``algo`` in this environment: the parent hash of every first block.

    Note that PYTHONHASHSEED changes the seed of *every* algorithm (sha256 included): processes sharing a
    cache must all have it set to the same value, or all have it unset.
    """
    return hash_fn(algo)(none_hash_seed(algo))


def assert_engine_seed_matches(algo: str) -> bool:
    """Compare the live ``NONE_HASH`` of vLLM in this process with ours; raise on mismatch.

    Returns ``True`` when a comparison happened and matched, ``False`` when there is nothing to compare
    (vLLM's ``kv_cache_utils`` not imported, or ``init_none_hash`` not run yet: only the EngineCore process
    runs it, worker processes never do). This module is not imported here on purpose: checking must not
    drag a whole engine into a tool process.
    """
    check_seed_is_stable(algo)
    mod = sys.modules.get("vllm.v1.core.kv_cache_utils")
    engine_hash = getattr(mod, "NONE_HASH", None) if mod is not None else None
    if engine_hash is None:
        return False
    ours = none_hash(algo)
    if engine_hash == ours:
        return True
    engine_seed = getattr(mod, "_NONE_HASH_SEED", None)
    matching = [
        name for name in HASH_ALGOS if engine_seed is not None and _HASH_FNS[name](engine_seed) == engine_hash
    ]
    if engine_seed is not None and engine_seed != none_hash_seed(algo) and len(engine_seed) == 64:
        why = (
            "the engine drew a random per-process seed (PYTHONHASHSEED was unset when it called "
            "init_none_hash), so nothing it caches can be found by another process"
        )
    elif matching and algo not in matching:
        why = f"the engine hashes with prefix_caching_hash_algo={matching[0]}, not {algo}"
    else:
        why = (
            f"the engine seeded NONE_HASH from {engine_seed!r} but this process would use "
            f"{none_hash_seed(algo)!r} (PYTHONHASHSEED changed, or differs between processes)"
        )
    raise UnstableHashSeedError(
        f"vLLM's NONE_HASH ({engine_hash.hex()}) differs from tiercache's ({ours.hex()}) for algo={algo}: "
        f"{why}. Set the same PYTHONHASHSEED (or none at all with sha256/sha256_cbor) for every vLLM and "
        "tiercache process and configure the same prefix_caching_hash_algo everywhere."
    )


# --------------------------------------------------------------------------------------------------------
# Extra keys (generate_block_hash_extra_keys)
# --------------------------------------------------------------------------------------------------------


class MMInput(NamedTuple):
    """One multimodal item of a prompt: where its placeholder tokens are and its full identifier.

    ``identifier`` is vLLM's ``MultiModalFeatureSpec.identifier`` (the mm hash, prefixed with
    ``"{lora_name}:"`` when the engine runs with ``enable_tower_connector_lora`` and a LoRA request): the
    whole string, never truncated.
    """

    offset: int
    length: int
    identifier: str


def _distinct(value: str, seen: set[int]) -> str:
    """Return ``value`` or an equal copy so no string object occurs twice in one block's key.

    Why: pickle memoises repeated *objects*, so ``("a", x, x)`` and ``("a", x, copy_of_x)`` pickle to
    different bytes. In the engine every identifier/name arrives through msgspec IPC or a fresh hash
    computation, hence as distinct objects; a caller handing us the same object twice (the same image
    twice in one block) would otherwise get a different sha256/xxhash than the engine.
    """
    if id(value) in seen:
        value = value.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")
    seen.add(id(value))
    return value


def extra_keys_for_block(
    start: int,
    end: int,
    *,
    mm_inputs: Sequence[tuple[int, int, str]] = (),
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    is_first_block: bool | None = None,
) -> tuple[Any, ...] | None:
    """The ``extra_keys`` vLLM 0.32 builds for the block of tokens ``[start, end)``.

    Order and shapes are vLLM's: ``("lora", lora_name, lora_path)`` (every block of a LoRA request;
    ``lora_path`` is ``LoRARequest.lora_path``, which vLLM 0.32 requires to be non-empty), then
    ``("mm", identifier, offset - start)`` for each item overlapping the block in prompt order, then
    ``("cache_salt", salt)`` on the first block only when the salt is non-empty. ``None`` when there is
    nothing (vLLM never passes an empty tuple). ``is_first_block`` defaults to ``start == 0``, which is
    the engine's rule. Prompt-embeds requests (``("prompt_embeds", digest)``) are not supported.
    """
    seen: set[int] = set()
    keys: list[Any] = []
    if lora_name is not None:
        if not lora_path:
            raise ValueError(
                "vLLM 0.32 hashes ('lora', lora_name, lora_path) into every block: pass the lora_path"
            )
        keys.append(("lora", _distinct(lora_name, seen), _distinct(lora_path, seen)))
    for offset, length, identifier in sorted(mm_inputs, key=lambda item: item[0]):
        # Overlap test equivalent to vLLM's cursor walk for sorted, non-overlapping placeholders.
        if offset < end and offset + length > start:
            keys.append(("mm", _distinct(identifier, seen), offset - start))
    first = (start == 0) if is_first_block is None else is_first_block
    if first and cache_salt:
        keys.append(("cache_salt", _distinct(cache_salt, seen)))
    return tuple(keys) if keys else None


@dataclass(frozen=True)
class BlockExtraKeys:
    """Everything of a request that enters block hashes besides tokens; callable as ``(start, end)``.

    Pass an instance as ``extra_keys_per_block`` to :func:`block_hashes` to reproduce the engine's
    ``request.block_hashes`` for requests with images, LoRA and cache_salt.
    """

    mm_inputs: tuple[MMInput, ...] = ()
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.lora_name is not None and not self.lora_path:
            raise ValueError("a LoRA request needs its lora_path: vLLM 0.32 hashes it into every block")
        items = tuple(sorted((MMInput(*item) for item in self.mm_inputs), key=lambda m: m.offset))
        for item in items:
            if item.length < 0 or item.offset < 0:
                raise ValueError(f"multimodal placeholder {item} has a negative offset or length")
            if not item.identifier:
                raise ValueError("a multimodal input needs its full, non-empty identifier")
        object.__setattr__(self, "mm_inputs", items)

    def __call__(self, start: int, end: int) -> tuple[Any, ...] | None:
        return extra_keys_for_block(
            start,
            end,
            mm_inputs=self.mm_inputs,
            lora_name=self.lora_name,
            lora_path=self.lora_path,
            cache_salt=self.cache_salt,
        )

    @property
    def is_empty(self) -> bool:
        """True when no block gets extra keys (plain text, no LoRA, no salt)."""
        return not self.mm_inputs and self.lora_name is None and not self.cache_salt


# --------------------------------------------------------------------------------------------------------
# Chaining (hash_block_tokens / get_request_block_hasher)
# --------------------------------------------------------------------------------------------------------


def hash_block(
    algo: str, parent: bytes | None, block_tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> bytes:
    """One link of the chain: vLLM's ``hash_block_tokens`` with our ``NONE_HASH`` for a falsy parent."""
    parent_hash = parent if parent else none_hash(algo)
    return hash_fn(algo)((parent_hash, tuple(block_tokens), extra_keys))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    algo: str,
    *,
    extra_keys_per_block: ExtraKeysSource | None = None,
    parent: bytes | None = None,
    start_token: int = 0,
) -> list[bytes]:
    """Chain hashes of the FULL blocks of ``token_ids``; a trailing partial block is ignored, like vLLM.

    ``parent`` continues an existing chain (``token_ids`` are then the tokens after it, and
    ``start_token`` their absolute position so extra keys see real offsets; it must be a multiple of
    ``block_size``). A callable ``extra_keys_per_block`` gets absolute ``(start, end)`` token positions; a
    sequence gives one entry per block hashed by this call. ``block_size`` must be vLLM's hash block size
    (``cache_config.block_size`` for single-group models).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start_token < 0 or start_token % block_size:
        raise ValueError(
            f"start_token {start_token} is not a non-negative multiple of block_size {block_size}"
        )
    if parent and start_token == 0 and callable(extra_keys_per_block):
        # Extra keys depend on absolute positions (salt on block 0, mm offsets): guessing 0 would be wrong.
        raise ValueError("continuing a chain from `parent` needs start_token= (the absolute token position)")
    fn = hash_fn(algo)
    prev = parent if parent else none_hash(algo)
    # numpy/torch ints pickle differently from Python ints: hash what the engine hashes (a list of int).
    tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    num_blocks = len(tokens) // block_size
    if extra_keys_per_block is not None and not callable(extra_keys_per_block):
        if len(extra_keys_per_block) < num_blocks:
            raise ValueError(f"{len(extra_keys_per_block)} extra-key entries for {num_blocks} full blocks")
    out: list[bytes] = []
    for i in range(num_blocks):
        lo = i * block_size
        if extra_keys_per_block is None:
            extra = None
        elif callable(extra_keys_per_block):
            extra = extra_keys_per_block(start_token + lo, start_token + lo + block_size)
        else:
            extra = extra_keys_per_block[i]
        prev = fn((prev, tuple(tokens[lo : lo + block_size]), extra))
        out.append(prev)
    return out
