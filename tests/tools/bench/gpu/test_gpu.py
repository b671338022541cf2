"""`tiercache bench gpu`: its smoke run on CPU tensors (the same code a GPU machine runs), its refusal
without CUDA, and that it needs torch alone (the GPU machines have no vLLM)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

CLI = [sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "gpu"]


def _numbers(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield value


def test_smoke_run_on_cpu_measures_every_section():
    done = subprocess.run([*CLI, "--device", "cpu", "--quick", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert "smoke run" in results["device"]
    assert results["link"]["h2d_gbps"] > 0 and results["link"]["d2h_gbps"] > 0
    assert [round(row["record_mib"], 2) for row in results["movers"]] == [1.0, 8.0]
    for row in results["movers"]:
        assert row["gather_gbps"] > 0 and row["scatter_gbps"] > 0 and row["gather_share"] > 0
        assert row["scatter_pageable_gbps"] > 0 and row["records_pinned"] is False  # no pinned memory on CPU
    for key in ("overlap", "overlap_pageable"):
        overlap = results[key]
        assert overlap["layers"] == 8 and overlap["load_s"] > 0 and overlap["compute_s"] > 0
        assert overlap["together_s"] >= overlap["exposed_s"] >= 0
        assert 0 <= overlap["hidden_share"] <= 1 and overlap["loader_issue_s"] > 0
        assert overlap["issued_first_s"] > 0 and overlap["issued_first_exposed_share"] >= 0
    assert [round(row["record_mib"], 2) for row in results["disk_hits"]] == [1.0, 8.0]
    assert all(row["pageable_gbps"] > 0 and row["pinned_gbps"] > 0 for row in results["disk_hits"])
    paths = [row["path"] for row in results["reads"]]
    assert paths[0].startswith("POSIX") and results["reads"][0]["gbps"] > 0
    assert "no CUDA device" in results["reads"][1]["note"]
    assert all(math.isfinite(number) for number in _numbers(results))
    for section in ("link limit", "movers", "layerwise overlap", "disk tier hits", "reads into device memory"):
        assert section in done.stderr  # progress lines


def test_without_cuda_it_refuses_instead_of_measuring_nothing():
    assert not torch.cuda.is_available()
    done = subprocess.run(CLI, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device here" in done.stderr and "--device cpu" in done.stderr
    assert done.stdout == ""


def test_it_needs_torch_alone():
    code = ("import sys, vllm_tiercache.tools.bench.gpu.command, vllm_tiercache.tools.cli; "
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_gpu_check_script_without_cuda_says_so_and_fails(tmp_path):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(root / "scripts" / "gpu-check.sh")], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 3
    assert "no CUDA device here" in done.stderr and "nothing ran" in done.stderr
    assert not list(tmp_path.iterdir())  # no logs pretending a run
