"""A wrong setting of ours stops vLLM while it builds its config, before any weights load.

Before this check, a KV tier `kind: ssd` or an unknown encoder-manager option surfaced 14-15 s into the
start with the tiny model (minutes with a real one), after the weights were loaded and the KV cache
sized, inside a worker traceback. Now `EngineArgs.create_engine_config` (the path of the OpenAI server
and of `LLM(...)`) raises one `ConfigError` naming the vLLM setting, the field, the bad value and the
fix; no engine process is started. Each case is timed in the test log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.models import REPO
from vllm_tiercache.shared.store.registry import tier_kinds

pytestmark = pytest.mark.engine

_KV = "kv_transfer_config (--kv-transfer-config)"
_EC = "ec_transfer_config (--ec-transfer-config)"
_MANAGER = "ec_manager_config (--ec-manager-config)"
_MANAGERS = "vllm_tiercache.eccache.managers."


def _kv(extra: dict, **transfer: object) -> dict:
    return {"kv_transfer_config": {"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": extra, **transfer}}


def _manager(cls: str, options: dict) -> dict:
    return {"ec_manager_config": {"encoder_cache_manager_cls": _MANAGERS + cls, "manager_config": options}}


#: (name, EngineArgs keywords, pieces the message must hold)
CASES: list[tuple[str, dict, list[str]]] = [
    ("a tier kind that does not exist", _kv({"tiers": [{"kind": "ssd"}]}),
     [_KV, "tiers[0].kind", "'ssd'", ", ".join(tier_kinds())]),
    ("a misspelled connector option", _kv({"chunk_sise": 256}), [_KV, "chunk_sise", "did you mean 'chunk_size'"]),
    ("a disk path under a file", _kv({"tiers": [{"kind": "disk", "path": "{model}/config.json/cache"}]}),
     [_KV, "tiers[0].path", "config.json' is not a directory", "a local directory this user can create and write"]),
    ("a key ring that cannot be read", _kv({"encryption": {"ring": "{model}/absent-ring.json"}}),
     [_KV, "encryption.ring", "cannot read the ring file", "absent-ring.json", "env:NAME"]),
    ("two failure policies that disagree",
     _kv({"load_failure_policy": "fail"}, kv_load_failure_policy="recompute"),
     [_KV, "kv_load_failure_policy conflict", "'fail'", "'recompute'"]),
    ("a MultiConnector child of ours",
     {"kv_transfer_config": {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"connectors": [
                                 {"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"tiers": [{"kind": "memory", "capacity": 0}]}}]}}},
     [f"{_KV} connectors[0]", "tiers[0].capacity"]),
    ("an encoder cache option", {"ec_transfer_config": {"ec_connector": "TieredECConnector", "ec_role": "ec_both",
                                                        "ec_connector_extra_config": {"encoder_cache_policy": "mru"}}},
     [_EC, "encoder_cache_policy", "'mru'"]),
    ("a manager class that does not exist", _manager("LRUEncoderCacheManger", {}),
     [_MANAGER, "did you mean 'LRUEncoderCacheManager'", _MANAGERS + "WTinyLFUEncoderCacheManager"]),
    ("another policy for a fixed-policy manager", _manager("LRUEncoderCacheManager", {"policy": "wtinylfu"}),
     [_MANAGER, "manager_config.policy", "PolicyEncoderCacheManager"]),
    ("an option the policy does not take", _manager("PolicyEncoderCacheManager",
                                                    {"policy": "lfu", "agingperiod": 10}),
     [_MANAGER, "manager_config.agingperiod", "did you mean 'aging_period'"]),
]

_JOB = r"""
import json, sys, time
from vllm.engine.arg_utils import EngineArgs
model, cases = sys.argv[1], json.loads(sys.argv[2])
results = {}
for name, kwargs in cases.items():
    started = time.monotonic()
    try:
        EngineArgs(model=model, **kwargs).create_engine_config()
        results[name] = {"error": None}
    except Exception as exc:
        results[name] = {"type": type(exc).__name__, "error": str(exc)}
    results[name]["seconds"] = time.monotonic() - started
print("RESULTS " + json.dumps(results))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def test_each_mistake_is_refused_while_vllm_builds_its_config(tiny_llama: Path) -> None:
    cases = {name: kwargs for name, kwargs, _ in CASES}
    cases["a valid config of both connectors and a manager"] = {
        **_kv({"tiers": [{"kind": "memory", "capacity": "64MiB"},
                         {"kind": "disk", "path": "{model}/../preflight-disk/d", "capacity": "64MiB"}]}),
        "ec_transfer_config": {"ec_connector": "TieredECConnector", "ec_role": "ec_both"},
        **_manager("PolicyEncoderCacheManager", {"policy": "lfu", "aging_period": 10}),
    }
    # the same disk tier, with time for the connectors to finish their writes when the engine stops
    cases["a valid config given time to stop"] = {
        **_kv({"tiers": [{"kind": "memory", "capacity": "64MiB"},
                         {"kind": "disk", "path": "{model}/../preflight-disk/d", "capacity": "64MiB"}]}),
        "shutdown_timeout": 15,
    }
    # a consumer never writes: nothing queued to lose, no warning at vLLM's default timeout
    cases["a valid consumer config"] = _kv({"tiers": [{"kind": "disk", "path": "{model}/../preflight-disk/c"}]},
                                           kv_role="kv_consumer")
    cases_json = json.dumps(cases).replace("{model}", str(tiny_llama))
    proc = subprocess.run([sys.executable, "-c", _JOB, str(tiny_llama), cases_json], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    for name, _, pieces in CASES:
        got = results[name]
        print(f"{name}: refused in {got['seconds']:.3f} s: {got.get('type')}: {got['error']}")
        assert got.get("type") == "ConfigError", (name, got)
        for piece in pieces:
            assert piece in got["error"], (name, piece, got["error"])
    assert results["a valid config of both connectors and a manager"]["error"] is None
    assert results["a valid config given time to stop"]["error"] is None
    assert results["a valid consumer config"]["error"] is None
    log = proc.stdout + proc.stderr  # vLLM's logger writes to stdout
    assert "settings checked before the model loads" in log
    # vLLM's default shutdown_timeout 0 kills the engine before queued disk writes land: said once, for the
    # writing config without the time to stop (not for it given 15 s, nor for the consumer), naming the
    # tier and the flag
    warning = "writes still queued for the disk tier(s) at that moment are lost"
    assert log.count(warning) == 1 and "pass --shutdown-timeout 15" in log, log[-3000:]
    assert not (tiny_llama.parent / "preflight-disk").exists()  # checked, not created: no side effects
    # Nothing started: no engine process, no weights read.
    assert "EngineCore" not in log and "Loading weights" not in log


def test_the_openai_server_stops_before_the_engine_starts(tiny_llama: Path) -> None:
    """The flag path: the server exits non-zero in its first seconds, the last line names the field."""
    flag = json.dumps({"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"tiers": [{"kind": "ssd"}]}})
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
                           "--port", "0", "--kv-transfer-config", flag], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    print(f"server refused the config after {seconds:.1f} s (imports included)")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "ConfigError: vllm-tiercache: kv_transfer_config (--kv-transfer-config): tiers[0].kind: " \
           "invalid value 'ssd'" in last, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "EngineCore" not in log and "Loading weights" not in log
