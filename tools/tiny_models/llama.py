"""Tiny random-weight Llama-style models generated locally, for tests, benchmarks and the demo.

No model can be downloaded where this project is tested, and a cache must give the same tokens as
recomputation whatever the weights are, so random weights prove correctness as well as real ones do.
The tokenizer is byte-level with no merges (one token per byte): built offline, deterministic, and able
to encode any text the demo sends through the OpenAI API.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

#: Shapes the CPU attention backend of vLLM accepts: head size 64 or 128 (block size is a multiple of 32).
_ALLOWED_HEAD_SIZES = (64, 128)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Architecture of a generated model. Every field changes the weights or the KV layout."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_size not in _ALLOWED_HEAD_SIZES:
            raise ValueError(
                f"head size {self.head_size} (hidden_size/num_heads) is not one of {_ALLOWED_HEAD_SIZES}, "
                "which vLLM's CPU attention needs"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


#: The ~130M-parameter model of the KV benchmark (12 layers, hidden 1024, 16 heads, 4 KV heads).
BENCH_SPEC = TinyLlamaSpec(
    hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, intermediate_size=2816, seed=1
)


def _byte_tokenizer_json() -> dict:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens plus <s>, </s>, <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return json.loads(tokenizer.to_str())


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    (out / "tokenizer.json").write_text(json.dumps(_byte_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 1 << 20,
                "add_bos_token": False,
                "chat_template": (
                    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}"
                ),
            }
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


#: The file that records which spec a generated model directory holds (written last).
SPEC_STAMP = "tiercache_spec.json"


def is_generated(out: Path, spec: Any) -> bool:
    """Whether ``out`` already holds the model of ``spec`` (a dataclass), so a generator can reuse it."""
    stamp = out / SPEC_STAMP
    return stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(asdict(spec)))


def save_generated(out: Path, model: Any, spec: Any, vocab_size: int) -> Path:
    """Write a generated model directory: weights and config (safetensors), the byte-level tokenizer, and
    the spec stamp last, so a directory whose writing was interrupted is never reused."""
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out, vocab_size)
    (out / SPEC_STAMP).write_text(json.dumps(asdict(spec)))
    return out


def make_tiny_llama(out_dir: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write a random-weight Llama model directory vLLM can serve; reuse it if the spec is unchanged."""
    spec = spec or TinyLlamaSpec()
    spec.validate()
    out = Path(out_dir)
    if is_generated(out, spec):
        return out
    out.mkdir(parents=True, exist_ok=True)

    from transformers import LlamaConfig, LlamaForCausalLM

    vocab_size = 259  # 256 bytes + 3 specials
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger-than-default init so greedy decoding depends visibly on the whole context.
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    return save_generated(out, model.to(getattr(torch, spec.dtype)), spec, vocab_size)
