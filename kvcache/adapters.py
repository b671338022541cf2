"""Which LoRA adapter's weights a request runs with, named by content: part of its chunks' names.

Why: vLLM 0.32 hashes ``("lora", lora_name, lora_path)`` into every block of a LoRA request, so the
blocks' hashes change with the adapter's name and path but not with its weights. An adapter retrained
and written again under the same path (the everyday fine-tuning workflow, as for base weights: see
`vllm_tiercache.shared.naming.weights_identity`) would meet the old adapter's KV after a restart and give
outputs that match neither adapter. So a LoRA request's chunks are named by vLLM's block hash mixed with a
digest of the adapter's files (`vllm_tiercache.kvcache.naming.adapter_chunk_hash`, which `RequestNames`
applies with the other salts), computed once per file and remembered by its stat signature like the base
weights' digest.

An adapter vLLM loads from somewhere this process cannot read as a local directory (a hub id, a remote
resolver) has no digest here: its requests are kept out of the store both ways (no lookup, no save) with
one warning per adapter, rather than keyed by a name that does not follow its weights.

The digest is computed on a background thread, never on vLLM's scheduling thread: reading a large adapter
from a cold disk, or waiting for the digest cache's lock while another process digests a base model, would
stall every request of the engine. The first request of a newly loaded adapter waits for it at most
`KVSchedulerSide.adapter_wait_s` (1 s); until the digest is ready the adapter's requests are neither
looked up nor saved (they are computed, as without the cache).

Encoder outputs of tower-connector LoRA requests are keyed by the adapter's name (`shared/naming/keys.py`), not
its files: retraining such an adapter in place needs `tiercache evict` for the encoder records.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.naming.weights_identity import digest_directory

log = logging.getLogger(__name__)


class AdapterDigests:
    """The content digest of each LoRA adapter a scheduler sees, computed once per loaded adapter.

    Keyed by vLLM's ``(lora_int_id, lora_name, lora_path)``: vLLM gives an adapter loaded again (a new
    `/v1/load_lora_adapter`) a new id, and a restart starts empty, so a rewritten adapter is digested
    again; unchanged files cost a stat each (the digest cache of `digest_directory`).
    """

    def __init__(self, cache_dir: Path | None = None) -> None:
        self._cache_dir = cache_dir
        self._digests: dict[tuple[Any, ...], Future[str | None]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def digest(self, lora_request: Any, wait_s: float = 0.0) -> str | None:
        """The hex digest of the adapter's files; None while it is being computed (waiting at most
        ``wait_s``) and for an adapter that cannot be named by content."""
        ident = (getattr(lora_request, "lora_int_id", None), getattr(lora_request, "lora_name", None),
                 getattr(lora_request, "lora_path", None))
        with self._lock:
            future = self._digests.get(ident)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercache-lora-digest")
                future = self._digests[ident] = self._pool.submit(self._compute, *ident)
        try:
            return future.result(timeout=wait_s)
        except TimeoutError:
            return None

    def _compute(self, lora_id: Any, name: Any, path: Any) -> str | None:
        try:
            directory = Path(os.path.expanduser(str(path))) if path else None
            if directory is None or not directory.is_dir():
                reason = "not a local directory"
            else:
                digest, _ = digest_directory(directory.resolve(), self._cache_dir)
                return digest
        except Exception as exc:  # unreadable files, a symlink loop: the adapter is not named, never a crash
            reason = f"{type(exc).__name__}: {exc}"
        log.warning("TieredKVConnector: LoRA adapter %r (id %s) at %r cannot be named by its files (%s); its "
                    "requests are neither looked up nor saved. Give vLLM the adapter as a local directory to "
                    "cache them", name, lora_id, path, reason)
        return None
