"""Tags a serving request gives the records it saves: ``kv_transfer_params={"tiercache_tags": [...]}``.

Why through ``kv_transfer_params``: it is the per-request field the OpenAI server takes from the request
body and vLLM keeps on its `Request` whichever connectors run, and `tiercache precompute docs` tags its
documents the same way, so a precomputed document and a request that saves it name it alike. Both
connectors read it on their scheduler side: the KV one once per save plan (`ChunkSave.tags`, written into
each record's meta by `KVSaver`), the encoder one per encoder input it lets vLLM compute
(`TieredECMetadata.tags`, written by the EC worker's save). `tiercache evict --tag` / `tiercache pin --tag`
find the records by them.

A request with bad tags is served all the same, its records saved untagged, with one warning per process:
a tag is the operator's label, never a reason to fail a request.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_tiercache.shared.store.tags import validate_tags

log = logging.getLogger(__name__)

#: The key of a request's tags inside ``kv_transfer_params``.
TAGS_PARAM = "tiercache_tags"
_warned: set[str] = set()


def request_tags(request: Any) -> tuple[str, ...]:
    """The request's valid tags (() when it gives none, or bad ones: warned once per process)."""
    params = getattr(request, "kv_transfer_params", None)
    raw = params.get(TAGS_PARAM) if isinstance(params, dict) else None
    if not raw:
        return ()
    try:
        return tuple(validate_tags(raw))
    except ValueError as exc:
        if "bad" not in _warned:
            _warned.add("bad")
            log.warning("tiercache: request %s: kv_transfer_params.%s ignored (%s); its records are "
                        "saved without tags", getattr(request, "request_id", "?"), TAGS_PARAM, exc)
        return ()
