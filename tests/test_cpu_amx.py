"""vLLM's CPU attention kernel over KV with context, as the first AMX use of a process, after `allow_amx_tiles`.

That is the first call a KV connector causes in a fresh worker (a first request attending over loaded KV).
Without the permission it dies with SIGILL on CPUs with AMX (seen on Sapphire Rapids; see
`kvcache.cpu_warmup`). On CPUs without AMX the kernel takes another ISA and the test checks the same call.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import torch
    from kvcache.cpu_warmup import allow_amx_tiles
    print("granted", allow_amx_tiles())
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype, block, head, heads, kv_heads = torch.bfloat16, 32, 64, 4, 2
    isa = _get_attn_isa(dtype, block, head, "auto")
    kv = torch.zeros((4, kv_heads, 2 * block, head), dtype=dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)
    query_len, seq_len = block, 3 * block  # a prefill over two blocks of context
    query = torch.randn((query_len, heads, head), dtype=dtype) * 0.1
    key = torch.randn((query_len, kv_heads, head), dtype=dtype) * 0.1
    value = torch.randn((query_len, kv_heads, head), dtype=dtype) * 0.1
    output = torch.empty((query_len, heads, head), dtype=dtype)
    starts = torch.tensor([0, query_len], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                   torch.arange(seq_len - query_len, seq_len, dtype=torch.int64), isa)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head, seq_lens=lens, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=starts,
        seq_lens=lens, scale=head**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.arange(4, dtype=torch.int32).reshape(1, 4), softcap=0, scheduler_metadata=meta,
        s_aux=None)
    assert torch.isfinite(output.float()).all()
    print("isa", isa, "ok")
    """
)


def test_attention_with_context_as_first_amx_call_survives_after_allow_amx_tiles() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"rc={proc.returncode} (-4 is SIGILL)\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert " ok" in proc.stdout
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    assert ("granted True" in proc.stdout) == amx, proc.stdout  # granted exactly where the CPU has AMX
