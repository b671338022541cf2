"""Run one real vLLM engine through an in-place weight update (the RL-loop flow) and write what it did.

Usage: python -m tests.support.weights_update_job SPEC.json OUT.json (started by `tests.fixtures.models.run_engine`
with ``job="tests.support.weights_update_job"``). One engine, in this order:

1. ``first``: the prompts, greedy (the connector saves them);
2. ``again``: the same prompts (hits);
3. the weights are replaced in place from ``spec["new_weights"]`` (vLLM's ``reload_weights`` worker RPC,
   what a training loop's weight sync amounts to), then vLLM's caches are reset the way vLLM's weight-update
   flow ends (``reset_prefix_cache(reset_connector=True)``, the call ``pause_generation(clear_cache=True)``
   makes in the engine core);
4. ``after``: the same prompts;
5. ``reference``: the same prompts with a fresh ``cache_salt``: every block hash differs, so neither vLLM nor
   the connector can find anything cached; they are computed with the new weights, in the same batch shape;
6. ``after_again``: the same prompts once more.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _generate(llm: Any, token_lists: list[list[int]], params: Any, salt: str | None = None) -> dict[str, Any]:
    """Greedy outputs of one batch of the prompts (each with `salt` as its ``cache_salt`` if given)."""
    from vllm.inputs import TokensPrompt

    prompts = []
    for tokens in token_lists:
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salt is not None:
            prompt["cache_salt"] = salt
        prompts.append(prompt)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "num_cached_tokens": [o.num_cached_tokens for o in outputs]}


def main(spec_path: str, out_path: str) -> None:
    spec: dict[str, Any] = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=spec["model"], dtype="bfloat16", enforce_eager=True, max_model_len=2048, block_size=32,
              enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=2048, seed=0,
              kv_transfer_config=KVTransferConfig(**spec["kv_transfer_config"]))
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    prompts = spec["prompts"]
    result: dict[str, Any] = {"first": _generate(llm, prompts, params), "again": _generate(llm, prompts, params)}
    started = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": spec["new_weights"]})
    result["reload_s"] = time.perf_counter() - started
    result["reset"] = llm.reset_prefix_cache(reset_connector=True)
    result["after"] = _generate(llm, prompts, params)
    result["reference"] = _generate(llm, prompts, params, salt=f"reference-{time.time_ns()}")
    result["after_again"] = _generate(llm, prompts, params)
    del llm
    with open(out_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
