"""The save path: a step's completed chunks copied out of vLLM's paged KV cache into the store."""
