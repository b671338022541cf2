"""`tiercache identity`: the cache identity an engine config would use, without starting an engine.

Why: a precompute job and the servers that read its records must agree on the namespace, the model's
canonical name, the weights digest and the fingerprints, or every lookup misses. Run this with the
serving engine's model, store config and engine options on each side and compare the lines (or
``--json``). Reading the weights once may take a while for a large model; later runs reuse the digests
(see `vllm_tiercache.shared.naming.weights_identity`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from vllm_tiercache.tools.jobs import JobError, engine_args_json, engine_config, fail, load_store_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Print the cache identity (model name, weights digest, namespace, KV and encoder "
                          "fingerprints) that a server with these options would use.")
    parser.add_argument("--model", required=True, help="model name or path, as given to the serving engine")
    parser.add_argument("--config", default=None, metavar="STORE",
                        help="store config: a YAML/JSON file or inline JSON (the connector's extra config)")
    parser.add_argument("--block-size", type=int, default=None, help="engine block_size (as serving)")
    parser.add_argument("--dtype", default=None, help="engine dtype (as serving)")
    parser.add_argument("--engine-args", default=None, metavar="JSON",
                        help='more vLLM engine arguments as a JSON object, e.g. \'{"tensor_parallel_size": 2}\'')
    parser.add_argument("--json", action="store_true", help="print the identity as JSON")


def identity(model: str, store: dict[str, Any] | None, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What `TieredKVConnector` and `TieredECConnector` would put in their keys for this engine config."""
    from vllm_tiercache.kvcache.blocks.layout import layout_tag
    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.naming.keys import EncoderIdentity, KVModelIdentity, weights_of

    config = StoreConfig.load(store or None)
    vllm_config = engine_config(model, engine_kwargs)
    weights = weights_of(vllm_config, config.model_version)
    layout = layout_tag(vllm_config)
    ranks = range(int(vllm_config.parallel_config.tensor_parallel_size))
    kv = [KVModelIdentity.from_vllm_config(vllm_config, layout, r, weights=weights) for r in ranks]
    out: dict[str, Any] = {
        "model": model,
        "name": weights.name,
        "weights": weights.digest,
        "weights_bytes": weights.nbytes,
        "namespace": config.namespace,
        "kv_fingerprint": kv[0].fingerprint,
        "kv_key_prefixes": [f"{config.namespace}|kv|{k.model}|{k.fingerprint}|tp{k.tp_size}r{k.tp_rank}|"
                            for k in kv],
        "encoder_fingerprint": None,
    }
    if vllm_config.model_config.is_multimodal_model:
        enc = EncoderIdentity.from_vllm_config(vllm_config, weights=weights)
        out["encoder_fingerprint"] = enc.encoder_fingerprint
    return out


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = engine_args_json(args.engine_args)
    for name in ("block_size", "dtype"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def run(args: argparse.Namespace) -> int:
    from vllm_tiercache.shared.config import ConfigError

    try:
        store = load_store_arg(args.config) if args.config else None
        # vLLM logs to stdout, bound when it is first imported (here): keep stdout for the answer.
        with contextlib.redirect_stdout(sys.stderr):
            result = identity(args.model, store, _engine_kwargs(args))
    except (ConfigError, JobError, ValueError, OSError) as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model        {result['name']}  (given as {result['model']})")
    size = f", {result['weights_bytes'] / 2**20:,.1f} MiB of files" if result["weights_bytes"] else ""
    print(f"weights      {result['weights']}{size}")
    print(f"namespace    {result['namespace']}")
    print(f"kv           fingerprint {result['kv_fingerprint']}; keys start with {result['kv_key_prefixes'][0]}")
    if result["encoder_fingerprint"]:
        print(f"encoder      fingerprint {result['encoder_fingerprint']}")
    return 0
