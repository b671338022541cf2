"""Encoder-cache half of vllm-tiercache: TieredECConnector and recency/frequency encoder cache managers."""
