"""The demo's producer step, run in a fresh process: `python -m vllm_tiercache.tools.demo.producer SPEC.json`.

Why a separate process per job: each precompute job builds a vLLM engine (engine core + worker
processes, vLLM globals, the connectors' per-process store). In its own process it is gone, with all its
memory, before the demo measures anything, and the consumer server can only find the entries through
the store's shared tier (disk here), exactly as a separate serving fleet would.

Jobs (two engines, because an `ec_producer` engine runs the encoder only and has no KV cache, so it
cannot also be the `kv_producer`):
- `images`: `tools.precompute.ec.precompute_images` (ec_producer over the page images).
- `docs`:   `tools.precompute.kv.precompute_docs` (kv_producer over `docNN.txt`, with `docNN.png` beside it
  in the prompt; prompts from `tools.precompute.kv.rag_prompt`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: Engine settings the producers and the consumer server must agree on (the KV key's fingerprint covers
#: dtype and block size; max_model_len bounds the prompt). `vllm_tiercache.tools.demo.server` passes the same flags.
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32", "enforce_eager": True, "block_size": 32, "max_model_len": 1024, "max_num_seqs": 4,
    "seed": 0, "enable_prefix_caching": False,
}


def main(spec_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    job = spec["job"]
    if job == "images":
        from vllm_tiercache.tools.precompute.ec import precompute_images

        summary = precompute_images(spec["model"], [Path(p) for p in spec["images"]], spec["store"],
                                    progress=False, engine_kwargs=dict(ENGINE_KWARGS))
    elif job == "docs":
        from vllm_tiercache.tools.precompute.kv import precompute_docs

        summary = precompute_docs(spec["model"], [Path(p) for p in spec["docs"]], spec["store"], template=None,
                                  progress=False, engine_kwargs=dict(ENGINE_KWARGS))
    else:
        raise SystemExit(f"unknown producer job {job!r}")
    Path(spec["out"]).write_text(json.dumps(summary.to_dict(), default=str))


if __name__ == "__main__":
    main(sys.argv[1])
