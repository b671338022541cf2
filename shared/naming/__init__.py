"""What names a record: vLLM-identical prefix hashing, cache keys, multimodal identifiers, weights identity."""
