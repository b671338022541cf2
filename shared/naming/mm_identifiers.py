"""Which multimodal identifiers a persistent or shared cache may store and serve.

Both connectors key records by vLLM's multimodal identifier (`MultiModalFeatureSpec.identifier`): the
encoder cache directly, the KV cache through the extra keys of its chunk hashes. That is safe only when
the identifier names the item's content. vLLM makes it so in three ways, and this module tells them apart:

- **content hash** (the normal case): a hex digest of the item (blake3, sha256 or sha512), optionally
  prefixed by a LoRA name (`"lora:<hash>"`, tower-connector LoRA). Always cacheable.
- **per-process counter name**: with `mm_processor_cache_gb=0` *and* prefix caching off, vLLM skips content
  hashing and names each item `{mm_req_id}-{modality}-{i}`, where `mm_req_id` comes from a counter of the
  API process (`_process_mm_uuids` in `vllm/renderers/base.py`). After a restart, or in another replica,
  the same name means another image. Never cacheable: serving one would give another image's encoder output
  or KV, i.e. silently wrong tokens.
- **user-supplied `multi_modal_uuids`**: vLLM's one exception, it takes the caller's word that the uuid
  names the content. Cacheable only when the store config says the operator vouches for them
  (`trust_multi_modal_uuids: true`): two tenants sending the same uuid for different images would share a
  record. `namespace` (per deployment) and `cache_salt` (per tenant, part of the KV chunk hashes) contain that
  risk for the KV cache; encoder records are separated by `namespace` only.

A multimodal engine in the counter mode can cache nothing multimodal without trusted uuids, so the
connectors refuse to start in it (`check_engine_mode`) with a message that names both settings and the fixes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from vllm_tiercache.shared.config import ConfigError

log = logging.getLogger(__name__)

#: vLLM's per-process item names: `renderer{api_process_rank}-mm-{counter}-{modality}-{index}` (0.32, 0.33).
PER_PROCESS_NAME = re.compile(r"^renderer\d+-mm-\d+-[A-Za-z0-9_]+-\d+$")
#: vLLM's content hashes: the hexdigest of blake3/sha256 (64 hex digits) or sha512 (128).
CONTENT_HASH = re.compile(r"^(?:[0-9a-f]{64}|[0-9a-f]{128})$")


def _item_part(identifier: str) -> str:
    """The identifier without the LoRA prefix vLLM adds for tower-connector LoRA (`"name:<mm_hash>"`)."""
    return identifier.rsplit(":", 1)[-1]


def uses_per_process_names(vllm_config: Any) -> bool:
    """True when this engine's vLLM names multimodal items by a process-local counter instead of a hash."""
    model_config = vllm_config.model_config
    mm_config = getattr(model_config, "multimodal_config", None)
    if mm_config is None:
        return False
    return mm_config.mm_processor_cache_gb == 0 and not vllm_config.cache_config.enable_prefix_caching


def refusal_message(connector: str) -> str:
    """One message for both connectors: what is wrong, why it matters, every way to fix it."""
    return (
        f"{connector}: this engine runs a multimodal model with mm_processor_cache_gb=0 and prefix caching "
        "off (enable_prefix_caching=False). In that mode vLLM does not hash images, audio or video; it names "
        "each item by a per-process counter, so after a restart or on another replica the same name means "
        "another item, and a persistent or shared cache would serve the wrong encoder output or KV. Fix one "
        "of: turn vLLM's prefix caching on (--enable-prefix-caching), or give its multimodal processor cache "
        "a size (--mm-processor-cache-gb 4, the default); or, if every request passes `multi_modal_uuids` "
        "that name their content, set `trust_multi_modal_uuids: true` in the connector's extra config "
        "(items without a uuid are then never cached)."
    )


@dataclass(frozen=True)
class MultiModalIdentifierPolicy:
    """Decides, per identifier or per request, whether the connectors may store and serve it."""

    trust_user_uuids: bool = False

    @classmethod
    def for_engine(cls, vllm_config: Any, *, trust_user_uuids: bool, connector: str) -> MultiModalIdentifierPolicy:
        """The policy of one engine; raises `ConfigError` where the engine's mode makes caching unsafe."""
        if uses_per_process_names(vllm_config):
            if not trust_user_uuids:
                raise ConfigError(refusal_message(connector))
            log.warning(
                "%s: multimodal items are named by a per-process counter (mm_processor_cache_gb=0, prefix "
                "caching off); only items with a user-supplied multi_modal_uuid are cached "
                "(trust_multi_modal_uuids=true)", connector,
            )
        return cls(trust_user_uuids=trust_user_uuids)

    def cacheable(self, identifier: str) -> bool:
        """True when `identifier` names its item's content (or a uuid the operator vouches for)."""
        item = _item_part(identifier)
        if CONTENT_HASH.match(item):
            return True
        if PER_PROCESS_NAME.match(item):
            return False
        return self.trust_user_uuids

    def request_cacheable(self, request: Any) -> bool:
        """True when every multimodal item of `request` is cacheable (a text-only request always is).

        The KV cache needs all of them: its chunk hashes carry every item's identifier as an extra key.
        """
        return all(self.cacheable(feature.identifier) for feature in (request.mm_features or ()))
