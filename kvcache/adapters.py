"""Which LoRA adapter's weights a request runs with, named by content: part of its chunks' names.

Why: vLLM 0.32 hashes ``("lora", lora_name, lora_path)`` into every block of a LoRA request, so the
blocks' hashes change with the adapter's name and path but not with its weights. An adapter retrained
and written again under the same path (the everyday fine-tuning workflow, as for base weights: see
`vllm_tiercache.shared.weights_identity`) would meet the old adapter's KV after a restart and give
outputs that match neither adapter. So a LoRA request's chunks are named by vLLM's block hash mixed with a
digest of the adapter's files (`adapter_chunk_hash`), computed once per file and remembered by its stat
signature like the base weights' digest.

An adapter vLLM loads from somewhere this process cannot read as a local directory (a hub id, a remote
resolver) has no digest here: its requests are kept out of the store both ways (no lookup, no save) with
one warning per adapter, rather than keyed by a name that does not follow its weights.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.weights_identity import digest_directory

log = logging.getLogger(__name__)

_PERSON = b"tiercache-lora"


def adapter_chunk_hash(chunk_hash: bytes, adapter_digest: str) -> bytes:
    """The name of a LoRA request's chunk: vLLM's hash at the chunk's last block, mixed with the adapter's
    content digest (same length as vLLM's hash, so everything downstream treats it alike)."""
    return hashlib.blake2b(chunk_hash + b"|" + adapter_digest.encode(), digest_size=len(chunk_hash),
                           person=_PERSON).digest()


class AdapterDigests:
    """The content digest of each LoRA adapter a scheduler sees, computed once per loaded adapter.

    Keyed by vLLM's ``(lora_int_id, lora_name, lora_path)``: vLLM gives an adapter loaded again (a new
    `/v1/load_lora_adapter`) a new id, and a restart starts empty, so a rewritten adapter is digested
    again; unchanged files cost a stat each (the digest cache of `digest_directory`).
    """

    def __init__(self, cache_dir: Path | None = None) -> None:
        self._cache_dir = cache_dir
        self._digests: dict[tuple[Any, ...], str | None] = {}

    def digest(self, lora_request: Any) -> str | None:
        """The hex digest of an adapter in a local directory's files, None when it cannot be named by content."""
        ident = (getattr(lora_request, "lora_int_id", None), getattr(lora_request, "lora_name", None),
                 getattr(lora_request, "lora_path", None))
        if ident not in self._digests:
            self._digests[ident] = self._compute(*ident)
        return self._digests[ident]

    def _compute(self, lora_id: Any, name: Any, path: Any) -> str | None:
        directory = Path(os.path.expanduser(str(path))) if path else None
        if directory is not None and directory.is_dir():
            try:
                digest, _ = digest_directory(directory.resolve(), self._cache_dir)
                return digest
            except (OSError, ValueError) as exc:
                reason = str(exc)
        else:
            reason = "not a local directory"
        log.warning("TieredKVConnector: LoRA adapter %r (id %s) at %r cannot be named by its files (%s); its "
                    "requests are neither looked up nor saved. Give vLLM the adapter as a local directory to "
                    "cache them", name, lora_id, path, reason)
        return None
