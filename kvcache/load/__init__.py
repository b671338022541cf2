"""The load path: a step's hits read from the store into vLLM's paged KV cache, layer by layer."""
