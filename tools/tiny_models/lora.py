"""Tiny random-weight LoRA adapters for the generated Llama models (PEFT layout), for isolation tests.

Why generate them: nothing can be downloaded where the project is tested, and what a test needs from an
adapter is only that vLLM loads it and that it changes the model's outputs, so a request served with
another adapter's (or no adapter's) KV would give visibly wrong tokens. The adapter targets `q_proj` and
`v_proj` of every layer; `lora_B` is non-zero (PEFT would start it at zero, a no-op adapter).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec

#: The projections the adapter changes; `v_proj` changes the cached V values themselves.
TARGET_MODULES = ("q_proj", "v_proj")


def make_tiny_lora(out_dir: str | Path, spec: TinyLlamaSpec | None = None, *, rank: int = 8, seed: int = 1,
                   scale: float = 0.5) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` for a model of `spec`; return the dir.

    `seed` picks the weights, so two seeds give two different adapters of the same shape. `scale` is the
    standard deviation of the random A and B matrices: large enough that greedy tokens change.
    """
    from safetensors.torch import save_file

    spec = spec or TinyLlamaSpec()
    spec.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    hidden, kv_out = spec.hidden_size, spec.num_kv_heads * spec.head_size
    out_features = {"q_proj": hidden, "v_proj": kv_out}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, hidden, generator=gen) * scale).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features[module], rank, generator=gen) * scale).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
