"""A tiny random-weight Gemma 3 text decoder: sliding-window and global attention layers, for HMA tests.

vLLM serves it as `Gemma3ForCausalLM` with its hybrid KV cache manager: the sliding-window layers form
their own KV cache groups (only the window's blocks stay allocated), the global layers a full-attention
group. Same tokenizer as the tiny Llama (`vllm_tiercache.tools.tiny_models.llama`). CPU attention needs
head size 64 or 128 and a block size that is a multiple of 32; the window here is 64 tokens, so with
block_size 32 a hit's window is 2 blocks and prompts of a few hundred tokens leave the window many times.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_tiercache.tools.tiny_models.llama import is_generated, save_generated


@dataclass(frozen=True)
class TinyGemma3Spec:
    """Architecture of a generated Gemma 3 text model. Every field changes the weights or the KV layout."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    sliding_window: int = 64
    #: every `sliding_window_pattern`-th layer is global (full attention), the others slide
    sliding_window_pattern: int = 2
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.sliding_window_pattern == 0 else "sliding_attention"
            for i in range(self.num_layers)
        ]

    def validate(self) -> None:
        if self.head_dim not in (64, 128):
            raise ValueError(f"head_dim {self.head_dim} is not 64 or 128, which vLLM's CPU attention needs")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        kinds = set(self.layer_types)
        if kinds != {"full_attention", "sliding_attention"}:
            raise ValueError(f"a hybrid model needs both layer kinds, got {sorted(kinds)}")


#: The KV benchmark's Gemma 3 shape (~the tiny Llama BENCH_SPEC's size): 12 layers, five sliding-window
#: layers (512 tokens) per global one as in the real Gemma 3, hidden 1024, 16 heads, 4 KV heads.
BENCH_SPEC = TinyGemma3Spec(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=64,
                            intermediate_size=2816, sliding_window=512, sliding_window_pattern=6, seed=1)


def make_tiny_gemma3(out_dir: str | Path, spec: TinyGemma3Spec | None = None) -> Path:
    """Write a random-weight Gemma 3 text model directory vLLM can serve; reuse it if the spec is unchanged."""
    spec = spec or TinyGemma3Spec()
    spec.validate()
    out = Path(out_dir)
    if is_generated(out, spec):
        return out
    out.mkdir(parents=True, exist_ok=True)

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    vocab_size = 259  # 256 bytes + 3 specials, as the tiny Llama
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        query_pre_attn_scalar=spec.head_dim,
        sliding_window=spec.sliding_window,
        layer_types=spec.layer_types,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(spec.seed)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        # Larger-than-default init so greedy decoding depends visibly on the context.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.08)
    return save_generated(out, model.to(getattr(torch, spec.dtype)), spec, vocab_size)
