"""Tiny random-weight BLIP-2-style models generated locally, for the encoder-cache tests and benchmark.

BLIP-2 is the vision-language model vLLM 0.32 runs here without torchvision: its image processor has a
PIL/numpy backend (`BlipImageProcessorPil`), which we pin in `preprocessor_config.json` so neither
transformers nor vLLM ever reach for the torchvision ("fast") one. Random weights prove the cache as well
as real ones do: a hit must give the same greedy tokens as recomputation whatever the weights are.

The language model is a small OPT (BLIP-2's original LM) with head size 64, which vLLM's CPU attention
accepts. The tokenizer is byte-level with no merges plus an `<image>` special token (vLLM's BLIP-2
processor looks it up by that name), so it is built offline and can encode any prompt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

_PARAMS_FILE = "tiercache_params.json"


@dataclass(frozen=True)
class TinyBlip2Spec:
    """Architecture of a generated model. Every field changes the weights or the processor."""

    vision_layers: int = 2
    vision_hidden: int = 64
    vision_heads: int = 2
    image_size: int = 32
    patch_size: int = 8
    qformer_layers: int = 1
    qformer_hidden: int = 64
    num_query_tokens: int = 8
    text_layers: int = 2
    text_hidden: int = 128
    text_heads: int = 2
    dtype: str = "float32"
    seed: int = 0

    def validate(self) -> None:
        if self.text_hidden // self.text_heads not in (64, 128) or self.text_hidden % self.text_heads:
            raise ValueError("the language model's head size must be 64 or 128 for vLLM's CPU attention")
        if self.image_size % self.patch_size:
            raise ValueError("image_size must be a multiple of patch_size")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError("dtype must be float32 or bfloat16 (what vLLM's CPU backend runs)")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


#: The benchmark's "large" vision tower: ViT-B/16-sized (12 layers, hidden 768, 224 px -> 197 tokens).
LARGE_VISION_SPEC = TinyBlip2Spec(
    vision_layers=12, vision_hidden=768, vision_heads=12, image_size=224, patch_size=16,
    qformer_layers=2, qformer_hidden=256, num_query_tokens=32, text_layers=1, text_hidden=1024, text_heads=16,
    seed=1,
)


def make_large_vision_tower(out_dir: str | Path, *, seed: int = 1) -> Path:
    """The bench's large model: same LM as the tiny one behind a 12-layer, 768-wide, 224 px vision tower."""
    return make_tiny_blip2(out_dir, spec=replace(LARGE_VISION_SPEC, seed=seed))


def _tokenizer():
    """Byte-level BPE without merges + `</s>`, `<pad>`, `<unk>`, `<image>`: offline and deterministic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<image>", normalized=False, special=True)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=1 << 16,
    )
    fast.image_token = "<image>"
    return fast


def make_tiny_blip2(
    out_dir: str | Path,
    *,
    spec: TinyBlip2Spec | None = None,
    vision_layers: int | None = None,
    vision_hidden: int | None = None,
    image_size: int | None = None,
    text_layers: int | None = None,
    seed: int | None = None,
) -> Path:
    """Write a random-weight BLIP-2 model directory vLLM can serve; return `out_dir`.

    Idempotent: a directory already holding a model with the same spec is left alone (the spec digest is
    stored next to the weights), so session fixtures and the benchmark can call this freely. The same spec
    always gives the same bytes (seeded init), so two processes generating it agree on every tensor.
    """
    spec = spec or TinyBlip2Spec()
    overrides = {
        k: v for k, v in dict(vision_layers=vision_layers, vision_hidden=vision_hidden,
                              image_size=image_size, text_layers=text_layers, seed=seed).items()
        if v is not None
    }
    spec = replace(spec, **overrides)
    spec.validate()
    out = Path(out_dir)
    marker = out / _PARAMS_FILE
    if marker.exists() and json.loads(marker.read_text()).get("digest") == spec.digest():
        return out

    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        OPTConfig,
    )
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    tokenizer = _tokenizer()
    vision = Blip2VisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
        image_size=spec.image_size, patch_size=spec.patch_size,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=spec.qformer_hidden, num_hidden_layers=spec.qformer_layers,
        num_attention_heads=max(1, spec.qformer_hidden // 64), intermediate_size=4 * spec.qformer_hidden,
        encoder_hidden_size=spec.vision_hidden, vocab_size=len(tokenizer),
    )
    text = OPTConfig(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, num_hidden_layers=spec.text_layers,
        ffn_dim=4 * spec.text_hidden, num_attention_heads=spec.text_heads, max_position_embeddings=1024,
        word_embed_proj_dim=spec.text_hidden, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )
    config = Blip2Config(
        vision_config=vision.to_dict(), qformer_config=qformer.to_dict(), text_config=text.to_dict(),
        num_query_tokens=spec.num_query_tokens, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
    )
    config.dtype = spec.dtype

    torch.manual_seed(spec.seed)
    model = Blip2ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # The default init (std 0.02) makes every image give nearly the same embedding (attention averages
        # the patches away), so a wrong or stale embedding would not change the tokens and the tests
        # could not tell a hit from garbage. Matrices of the vision side at std 0.1 make embeddings of
        # different images differ by ~40-90%; everything else gets small noise so no LayerNorm is exactly
        # the identity.
        gen = torch.Generator().manual_seed(spec.seed)
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.startswith("language_model"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    model = model.to(getattr(torch, spec.dtype))

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    image_processor = BlipImageProcessorPil(
        size={"height": spec.image_size, "width": spec.image_size}, do_convert_rgb=True
    )
    processor = Blip2Processor(image_processor, tokenizer, num_query_tokens=spec.num_query_tokens)
    processor.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # Pin the PIL backend by class name: the auto classes would otherwise pick the torchvision one.
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = tmp / name
        if path.exists():
            data = json.loads(path.read_text())
            target = data.get("image_processor", data)
            target["image_processor_type"] = "BlipImageProcessorPil"
            path.write_text(json.dumps(data, indent=2))
    (tmp / _PARAMS_FILE).write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
