"""Shared layer of vllm-tiercache: vLLM-identical prefix hashing, cache keys and the tiered store."""
