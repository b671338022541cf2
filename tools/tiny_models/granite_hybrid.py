"""A tiny random-weight hybrid SSM model: IBM Granite 4.0 "H" shape (mamba2 and attention layers).

vLLM serves it as `GraniteMoeHybridForCausalLM` (no experts: a dense shared MLP) with its hybrid KV cache
manager: the mamba layers form a `MambaSpec` group, the attention layers a full-attention group whose
block size vLLM raises to match the state's page size. Such a model cannot start at all without the
hybrid manager; TieredKVConnector keeps it on and claims no hits for it (`vllm_tiercache.kvcache.groups`).
Same tokenizer as the tiny Llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_tiercache.tools.tiny_models.llama import is_generated, save_generated


@dataclass(frozen=True)
class TinyGraniteHybridSpec:
    """Architecture of the generated model. Every field changes the weights or the cache layout."""

    hidden_size: int = 128
    #: "linear_attention" (mamba2) or "full_attention", per layer
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention", "linear_attention", "full_attention")
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 256
    mamba_n_heads: int = 4
    mamba_d_head: int = 64
    mamba_d_state: int = 16
    dtype: str = "bfloat16"
    seed: int = 0


def make_tiny_granite_hybrid(out_dir: str | Path, spec: TinyGraniteHybridSpec | None = None) -> Path:
    """Write the model directory vLLM can serve; reuse it if the spec is unchanged."""
    spec = spec or TinyGraniteHybridSpec()
    out = Path(out_dir)
    if is_generated(out, spec):
        return out
    out.mkdir(parents=True, exist_ok=True)

    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    vocab_size = 259
    config = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=len(spec.layer_types),
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        layer_types=list(spec.layer_types),
        num_local_experts=0,
        shared_intermediate_size=spec.intermediate_size,
        position_embedding_type="rope",
        mamba_n_heads=spec.mamba_n_heads,
        mamba_d_head=spec.mamba_d_head,
        mamba_d_state=spec.mamba_d_state,
        mamba_expand=spec.mamba_n_heads * spec.mamba_d_head // spec.hidden_size,
        mamba_chunk_size=256,
        mamba_n_groups=1,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    torch.manual_seed(spec.seed)
    model = GraniteMoeHybridForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    return save_generated(out, model.to(getattr(torch, spec.dtype)), spec, vocab_size)
