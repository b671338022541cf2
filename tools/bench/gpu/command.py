"""`tiercache bench gpu`: the CUDA paths against what the hardware gives, measured in the same run.

1. Mover throughput: the worker's gathers (device to host) and scatters (host to device) of records of
   16 and 128 blocks, against plain pinned ``copy_`` calls of the same sizes and against the link's
   limit (one large pinned copy). Scatters are measured from the records gathers make (what the memory
   tier keeps) and from pageable records (what disk and Redis reads give). Target: the movers reach 0.8
   of the plain copies.
2. Layerwise overlap: a fake forward of matmuls with every layer's KV loaded by a loader thread while
   the previous layer computes, as the connector's worker does, for memory-tier and pageable records.
   Target: the load time the forward still waits for is at most 10% of the loads' own time, when a
   layer computes about as long as it loads.
3. Disk-tier hits into GPU memory from the page cache: a disk tier's whole-record reads and the mover's
   scatters, with payloads read into pageable memory against pinned memory (what a CUDA worker gives).
4. Reads into GPU memory from a cold page cache: GDS (kvikio ``CuFile.read``) against a POSIX read into
   pinned memory and a copy to the device; and verifying the payload on the device against copying it
   back to the host. Target: GDS at least as fast as POSIX.

Needs only torch (no vLLM). Without a CUDA device it stops with status 2 unless ``--device cpu`` asks for
a smoke run of the same code on CPU tensors, whose numbers say nothing about GPUs. `scripts/gpu-check.sh`
runs this and the GPU test suite on a GPU machine in one command.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from vllm_tiercache.tools.bench.gpu.disk import disk_hits
from vllm_tiercache.tools.bench.gpu.io import reads_into_device
from vllm_tiercache.tools.bench.gpu.movers import Geometry, link_limit, mover_throughput, overlap
from vllm_tiercache.tools.cli import UsageError, writable_directory

RECORD_BLOCKS = (16, 128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu: a smoke run of the same code on CPU tensors")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (a smoke run)")
    parser.add_argument("--dir", help="directory for the read test's file (default: a temp dir); put it on the "
                                      "filesystem the GDS tier would use")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("no CUDA device here (torch.cuda.is_available() is False): run this on a machine with "
                         "an NVIDIA GPU (scripts/gpu-check.sh), or pass --device cpu for a smoke run")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    quick = args.quick or device.type == "cpu"
    geometry = Geometry(moved_bytes=(8 << 20) if quick else (256 << 20))
    rounds = 3 if quick else 7
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run: not a GPU figure)",
        "torch": torch.__version__,
        "geometry": {"num_kv_heads": geometry.num_kv_heads, "block_size": geometry.block_size,
                     "head_size": geometry.head_size, "dtype": str(geometry.dtype).removeprefix("torch."),
                     "moved_mib": geometry.moved_bytes >> 20},
    }
    progress("link limit")
    results["link"] = link_limit(device, (16 << 20) if quick else (1 << 30), rounds)
    results["movers"] = []
    for blocks in RECORD_BLOCKS:
        progress(f"movers, records of {blocks} blocks")
        results["movers"].append(mover_throughput(device, geometry, blocks, rounds))
    progress("layerwise overlap")
    results["overlap"] = overlap(device, geometry, 8 if quick else 32, rounds)
    results["overlap_pageable"] = overlap(device, geometry, 8 if quick else 32, rounds, pinned=False)
    with tempfile.TemporaryDirectory(dir=writable_directory(args.dir, "--dir") if args.dir else None) as work:
        progress("disk tier hits into device memory (page cache)")
        results["disk_hits"] = [disk_hits(device, geometry, Path(work), blocks, rounds) for blocks in RECORD_BLOCKS]
        progress("reads into device memory (cold page cache)")
        results["reads"] = reads_into_device(device, Path(work), (16 << 20) if quick else (1 << 30), rounds)
    print(json.dumps(results, indent=2) if args.json else format_report(results))
    return 0


def progress(what: str) -> None:
    print(f"tiercache bench gpu: {what}", file=sys.stderr, flush=True)


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(results: dict[str, Any]) -> str:
    link = results["link"]
    lines = [f"device: {results['device']}, torch {results['torch']}; KV blocks of {results['geometry']}",
             f"link limit (one large pinned copy): host->device {_num(link['h2d_gbps'])} GB/s, "
             f"device->host {_num(link['d2h_gbps'])} GB/s", "",
             "movers vs plain pinned copy_ of the same records (GB/s; target share >= 0.8); scatters of the records"
             " gathers make (the memory tier's) and of pageable records (disk and Redis reads)",
             f"{'record':>10} {'gather':>8} {'plain D2H':>10} {'share':>6} {'scatter':>8} {'plain H2D':>10} "
             f"{'share':>6} {'of link H2D':>11} {'pageable':>9} {'share':>6}"]
    for row in results["movers"]:
        lines.append(f"{row['record_mib']:>7.2f}MiB {_num(row['gather_gbps']):>8} {_num(row['plain_d2h_gbps']):>10} "
                     f"{_num(row['gather_share']):>6} {_num(row['scatter_gbps']):>8} {_num(row['plain_h2d_gbps']):>10} "
                     f"{_num(row['scatter_share']):>6} {_num(row['scatter_gbps'] / link['h2d_gbps']):>11} "
                     f"{_num(row.get('scatter_pageable_gbps')):>9} {_num(row.get('scatter_pageable_share')):>6}")
    for key, what in (("overlap", "memory-tier records"), ("overlap_pageable", "pageable records")):
        if key not in results:
            continue
        ov = results[key]
        lines += ["", f"layerwise overlap, {what}, {ov['layers']} layers of {ov['layer_mib']:.2f} MiB (target: exposed "
                      "<= 10% of the loads, when a layer computes as long as it loads)",
                  f"  forward alone {ov['compute_s'] * 1e3:.2f} ms, loads alone {ov['load_s'] * 1e3:.2f} ms, together "
                  f"{ov['together_s'] * 1e3:.2f} ms: exposed {ov['exposed_s'] * 1e3:.2f} ms = "
                  f"{ov['exposed_share'] * 100:.1f}% of the loads; {ov.get('hidden_share', 0) * 100:.0f}% of the "
                  f"shorter ran hidden; the loader thread issued its copies in "
                  f"{ov.get('loader_issue_s', 0) * 1e3:.2f} ms"]
        if "issued_first_s" in ov:
            lines.append(f"  issued before the forward on its own thread (load_mode=before_forward): "
                         f"{ov['issued_first_s'] * 1e3:.2f} ms, exposed "
                         f"{ov['issued_first_exposed_share'] * 100:.1f}% of the loads")
    if "disk_hits" in results:
        lines += ["", "disk tier hits into device memory, page cache warm (GB/s): payloads read into pageable memory "
                      "(staged) against pinned (a CUDA worker's)"]
        for row in results["disk_hits"]:
            lines.append(f"  records of {row['record_mib']:.2f} MiB: pageable {_num(row['pageable_gbps'])}, pinned "
                         f"{_num(row['pinned_gbps'])}  x{_num(row['gain'])}")
    lines += ["", "reads into device memory, cold page cache (target GDS >= POSIX)"]
    for row in results["reads"]:
        note = f"  ({row['note']})" if row.get("note") else ""
        vs = f"  x{_num(row['vs_posix'])} POSIX" if row.get("vs_posix") is not None else ""
        lines.append(f"  {row['path']:<42} {_num(row['gbps']):>7} GB/s{vs}{note}")
    return "\n".join(lines)
