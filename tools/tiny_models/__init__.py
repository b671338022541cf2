"""Random-weight models generated locally (no downloads): tiny Llama for KV work, tiny BLIP-2 for EC work."""

from vllm_tiercache.tools.tiny_models.blip2 import (
    LARGE_VISION_SPEC,
    TinyBlip2Spec,
    make_large_vision_tower,
    make_tiny_blip2,
)

__all__ = ["LARGE_VISION_SPEC", "TinyBlip2Spec", "make_large_vision_tower", "make_tiny_blip2"]
