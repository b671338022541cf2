"""vLLM's CPU attention kernel over KV with context, as the first AMX use of a process, after `allow_amx_tiles`.

That is the first call a KV connector causes in a fresh worker (a first request attending over loaded KV).
Without the permission it dies with SIGILL on CPUs with AMX (seen on Sapphire Rapids; see
`kvcache.load.cpu_warmup`). On CPUs without AMX the kernel takes another ISA and the test checks the same call.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    """
    import torch
    from vllm_tiercache.kvcache.load.cpu_warmup import allow_amx_tiles, attend_once
    print("granted", allow_amx_tiles())
    # A prefill of one block over two blocks of context, as the process's first attention call.
    isa = attend_once(num_heads=4, num_kv_heads=2, head_size=64, block_size=32, dtype=torch.bfloat16,
                      query_len=32, seq_len=96)
    print("isa", isa, "ok")
    """
)


def test_attention_with_context_as_first_amx_call_survives_after_allow_amx_tiles() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"rc={proc.returncode} (-4 is SIGILL)\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert " ok" in proc.stdout
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    assert ("granted True" in proc.stdout) == amx, proc.stdout  # granted exactly where the CPU has AMX
