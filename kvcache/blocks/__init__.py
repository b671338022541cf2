"""Moving whole blocks between vLLM's paged KV cache and host memory: the layout, the movers, pinned buffers."""
