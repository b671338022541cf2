"""Run one real vLLM engine in this (fresh) process and write what it generated to a JSON file.

Usage: python -m tests.engine_job SPEC.json OUT.json. Tests start it in a subprocess so every engine
(and its store) begins in a fresh process, as it would after a restart or on another machine.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(spec_path: str, out_path: str) -> None:
    spec: dict[str, Any] = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

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
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    rounds = []
    for prompts in spec["rounds"]:
        t0 = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
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
