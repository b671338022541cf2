"""Cache key types: what names a KV chunk or an encoder output in every tier.

A key must change whenever the cached bytes would change, and must not change otherwise, or the cache
either serves wrong tensors or never hits. The canonical text of a key is human-readable (stats, logs);
tiers only see ``StoreKey.digest``, so no key ever becomes a path.

KV chunk: ``{ns}|kv|{model}|{fingerprint}|tp{size}r{rank}|{chunk_hash hex}|L{layer or "all"}``
Encoder:  ``{ns}|enc|{model}|{encoder_fingerprint}|{mm identifier}``
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from vllm_tiercache.shared.naming.weights_identity import WeightsIdentity, resolve_weights
from vllm_tiercache.shared.store.api import StoreKey

__all__ = [
    "EncoderIdentity",
    "KVModelIdentity",
    "KeyFields",
    "encoder_key",
    "kv_chunk_key",
    "parse_key_text",
    "validate_field",
    "weights_of",
]

#: Control characters (C0, DEL, C1): they would corrupt logs and stats lines built from key texts.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

#: Bytes of the blake2b digest behind a fingerprint (16 hex chars): short for logs, ample for identities.
_FINGERPRINT_BYTES = 8

#: HF config entries that say where/how the config was loaded, not what the network computes.
_VOLATILE_HF_KEYS = frozenset(
    {"_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation"}
)


def validate_field(what: str, value: str) -> str:
    """Reject a key field that could make two different keys share one canonical text.

    ``|`` separates fields, so a namespace or model containing it could alias another key; control
    characters would corrupt the logs the text is printed to.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if "|" in value:
        raise ValueError(f"{what} {value!r} contains '|', which separates the fields of cache keys")
    if _CONTROL.search(value):
        raise ValueError(f"{what} {value!r} contains control characters, which cache keys do not allow")
    return value


@functools.lru_cache(maxsize=256)
def _valid_field(what: str, value: str) -> str:
    """`validate_field` for the few namespaces and group tags a process names keys with, checked once each
    (a hit names one record per chunk and layer)."""
    return validate_field(what, value)


def _fingerprint(tag: str, payload: dict[str, Any]) -> str:
    text = json.dumps({"tag": tag, **payload}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=_FINGERPRINT_BYTES).hexdigest()


def weights_of(vllm_config: Any, model_version: str | None = None) -> WeightsIdentity:
    """The weights a ``VllmConfig`` loads, named by content (see `vllm_tiercache.shared.naming.weights_identity`)."""
    mc = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    commit = getattr(getattr(mc, "hf_config", None), "_commit_hash", None)
    return resolve_weights(
        str(mc.model),
        revision=getattr(mc, "revision", None),
        hub_commit=commit if isinstance(commit, str) else None,
        model_version=model_version,
        download_dir=getattr(load_config, "download_dir", None),
    )


def _dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through (e.g. a kv cache dtype like ``"fp8"``)."""
    text = str(dtype)
    return text[len("torch.") :] if text.startswith("torch.") else text


@dataclass(frozen=True)
class KVModelIdentity:
    """Which KV cache a chunk belongs to: model, KV geometry and this process's tensor-parallel shard.

    ``dtype`` is the KV cache storage dtype (the model dtype when ``cache_dtype`` is ``"auto"``).
    ``layout`` names how the connector lays a chunk out in bytes (it is the connector's format, so it is
    part of the identity). ``weights`` names the weights by content (`weights_of`): new weights under the
    same path must never meet the old ones' KV, and ``model`` is the canonical name of the weights, not the
    string the user typed, so every spelling of one model shares its records. ``revision`` and
    ``quantization`` change the KV values while the name stays the same; like ``weights`` they enter the
    fingerprint only when set.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    layout: str
    tp_size: int
    tp_rank: int
    revision: str | None = None
    quantization: str | None = None
    weights: str | None = None

    def __post_init__(self) -> None:
        validate_field("model", self.model)
        validate_field("dtype", self.dtype)
        validate_field("layout", self.layout)
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex chars over everything that changes the KV bytes of a block (not the model name or TP rank,
        which appear in the key text on their own). Computed once: a hit names one record per chunk and
        layer, and a JSON dump plus a hash per name cost as much as copying the record."""
        payload: dict[str, Any] = {
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "block_size": self.block_size,
            "layout": self.layout,
        }
        if self.revision is not None:
            payload["revision"] = self.revision
        if self.quantization is not None:
            payload["quantization"] = self.quantization
        if self.weights is not None:
            payload["weights"] = self.weights
        return _fingerprint("kv-v1", payload)

    @functools.cached_property
    def key_fields(self) -> str:
        """The identity's part of every KV key text: ``{model}|{fingerprint}|tp{size}r{rank}``."""
        return f"{self.model}|{self.fingerprint}|tp{self.tp_size}r{self.tp_rank}"

    @classmethod
    def from_vllm_config(
        cls, vllm_config: Any, layout: str, tp_rank: int, *, weights: WeightsIdentity | None = None
    ) -> KVModelIdentity:
        """Read the identity from a ``vllm.config.VllmConfig`` (vLLM 0.32 names).

        ``weights`` defaults to `weights_of(vllm_config)`; pass it to resolve once for several ranks or
        with the operator's ``model_version``.

        ``num_layers`` is ``model_config.get_num_layers(parallel_config)`` (this pipeline stage's layers)
        and ``num_kv_heads`` is ``get_num_kv_heads(parallel_config)`` (per TP rank, 1 for MLA).
        """
        mc = vllm_config.model_config
        cc = vllm_config.cache_config
        pc = vllm_config.parallel_config
        cache_dtype = str(getattr(cc, "cache_dtype", "auto") or "auto")
        dtype = _dtype_name(mc.dtype) if cache_dtype == "auto" else cache_dtype
        quantization = getattr(mc, "quantization", None)
        revision = getattr(mc, "revision", None)
        weights = weights or weights_of(vllm_config)
        return cls(
            model=weights.name,
            dtype=dtype,
            num_layers=int(mc.get_num_layers(pc)),
            num_kv_heads=int(mc.get_num_kv_heads(pc)),
            head_size=int(mc.get_head_size()),
            block_size=int(cc.block_size),
            layout=layout,
            tp_size=int(pc.tensor_parallel_size),
            tp_rank=int(tp_rank),
            revision=None if revision is None else str(revision),
            quantization=None if quantization is None else str(quantization),
            weights=weights.digest,
        )


def kv_chunk_key(
    namespace: str, identity: KVModelIdentity, chunk_hash: bytes, layer: int | None, group: str | None = None
) -> StoreKey:
    """Key of one KV chunk: the chain hash of its last block, for one layer or (``None``) all layers.

    ``group`` tags the record of a layer in a KV cache group other than full attention (a sliding-window
    group: kind, window, block size; `vllm_tiercache.kvcache.groups.KVGroup.tag`); full-attention
    records carry none, so their keys are those of a model served without vLLM's hybrid KV manager.
    """
    _valid_field("namespace", namespace)
    if group is not None:
        _valid_field("group", group)
    if not isinstance(chunk_hash, bytes | bytearray) or not chunk_hash:
        raise ValueError(f"chunk_hash must be non-empty bytes, got {chunk_hash!r}")
    if layer is None:
        layer_text = "all"
    elif isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < identity.num_layers:
        layer_text = str(layer)
    else:
        raise ValueError(f"layer must be None or an int in [0, {identity.num_layers}), got {layer!r}")
    text = f"{namespace}|kv|{identity.key_fields}|{bytes(chunk_hash).hex()}|L{layer_text}"
    if group is not None:
        text += f"|G{group}"
    return StoreKey(text)


def _clean_hf_config(value: Any) -> Any:
    """A JSON-able copy of an HF config dict without load-location/version noise, recursively."""
    if isinstance(value, dict):
        return {str(k): _clean_hf_config(v) for k, v in value.items() if k not in _VOLATILE_HF_KEYS}
    if isinstance(value, list | tuple):
        return [_clean_hf_config(v) for v in value]
    return value


@dataclass(frozen=True)
class EncoderIdentity:
    """Which encoder produced an embedding: model name plus a fingerprint of what shapes its output."""

    model: str
    encoder_fingerprint: str

    def __post_init__(self) -> None:
        validate_field("model", self.model)
        validate_field("encoder_fingerprint", self.encoder_fingerprint)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, *, weights: WeightsIdentity | None = None) -> EncoderIdentity:
        """Fingerprint the weights (`weights_of`), dtype, revision, quantization and the whole HF config
        (vision tower, projector and the text hidden size the projector maps to), minus load-location noise.

        The whole config rather than a hand-picked ``vision_config`` because tower/projector settings live
        under model-specific names (``vision_config``, ``mm_projector_type``, ``vision_feature_layer``...);
        over-invalidating on a text-only change is safe, serving stale embeddings is not.
        """
        mc = vllm_config.model_config
        hf_config = mc.hf_config
        hf_dict = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
        mm_config = getattr(mc, "multimodal_config", None)
        weights = weights or weights_of(vllm_config)
        payload = {
            "weights": weights.digest,
            "dtype": _dtype_name(mc.dtype),
            "revision": getattr(mc, "revision", None),
            "quantization": getattr(mc, "quantization", None),
            "hf_config": _clean_hf_config(hf_dict),
            "mm_processor_kwargs": getattr(mm_config, "mm_processor_kwargs", None),
        }
        return cls(model=weights.name, encoder_fingerprint=_fingerprint("enc-v1", payload))


def encoder_key(namespace: str, identity: EncoderIdentity, mm_hash: str) -> StoreKey:
    """Key of one encoder output: the FULL ``MultiModalFeatureSpec.identifier``, LoRA prefix included.

    The identifier is the last field, so any character in it (even ``|``) cannot alias another key.
    """
    validate_field("namespace", namespace)
    if not isinstance(mm_hash, str) or not mm_hash:
        raise ValueError(f"mm_hash must be the full, non-empty multimodal identifier, got {mm_hash!r}")
    return StoreKey(f"{namespace}|enc|{identity.model}|{identity.encoder_fingerprint}|{mm_hash}")


#: ``tp{size}r{rank}`` and ``L{layer}`` / ``Lall`` fields of a KV key text (see `kv_chunk_key`).
_TP_FIELD = re.compile(r"tp(\d+)r(\d+)")
_LAYER_FIELD = re.compile(r"L(\d+|all)")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


@dataclass(frozen=True)
class KeyFields:
    """The parts of a stored key text, as `parse_key_text` reads them back.

    ``namespace``, ``kind`` and ``model`` are the first three fields of every key this module builds.
    The rest is filled only for a well-formed ``kv`` or ``enc`` text: ``fingerprint``; for ``kv`` also
    ``tp_size``, ``tp_rank``, ``chunk_hash`` and ``layer`` (``None``: all layers, as `kv_chunk_key`
    takes it) and ``group`` (the KV cache group's tag, None for full attention); for ``enc`` the full
    ``mm_identifier``.
    """

    namespace: str
    kind: str
    model: str
    fingerprint: str | None = None
    tp_size: int | None = None
    tp_rank: int | None = None
    chunk_hash: bytes | None = None
    layer: int | None = None
    mm_identifier: str | None = None
    group: str | None = None

    @property
    def complete(self) -> bool:
        """True when every field of its kind was read (a text `kv_chunk_key` or `encoder_key` builds)."""
        return self.fingerprint is not None


def parse_key_text(text: str) -> KeyFields | None:
    """The fields of a key text written by `kv_chunk_key` or `encoder_key`; None when it names nothing.

    Why here: the builders above own the layout, so the one reader of it sits beside them
    (`tiercache stats` groups records by namespace, kind and model; `tiercache evict` filters on them).
    Why lenient: a store also holds texts this version did not build (older layouts, the benchmarks'
    ``bench|...`` keys); any text of at least three fields with a namespace keeps its first three, so
    such records are still grouped and filtered by them. ``""`` (a record whose text was not kept), or
    fewer fields, gives None.
    """
    fields = text.split("|", 4) if text else []
    if len(fields) < 3 or not fields[0]:
        return None
    namespace, kind, model = fields[0], fields[1], fields[2]
    if kind == "kv":
        return _parse_kv(namespace, model, text.split("|")[3:]) or KeyFields(namespace, kind, model)
    if kind == "enc" and len(fields) == 5 and fields[3] and fields[4]:
        return KeyFields(namespace, kind, model, fingerprint=fields[3], mm_identifier=fields[4])
    return KeyFields(namespace, kind, model)


def _parse_kv(namespace: str, model: str, rest: list[str]) -> KeyFields | None:
    """The KV-only fields ``fingerprint|tp{size}r{rank}|{chunk hash hex}|L{layer}[|G{group}]``; None if
    malformed."""
    group = None
    if len(rest) == 5 and rest[4].startswith("G") and len(rest[4]) > 1:
        group, rest = rest[4][1:], rest[:4]
    if len(rest) != 4 or not rest[0]:
        return None
    tp, chunk_hex, layer = _TP_FIELD.fullmatch(rest[1]), rest[2], _LAYER_FIELD.fullmatch(rest[3])
    if tp is None or layer is None or not _HEX.fullmatch(chunk_hex):
        return None
    return KeyFields(namespace, "kv", model, fingerprint=rest[0], tp_size=int(tp.group(1)),
                     tp_rank=int(tp.group(2)), chunk_hash=bytes.fromhex(chunk_hex),
                     layer=None if layer.group(1) == "all" else int(layer.group(1)), group=group)
