"""Decoder KV-cache half of vllm-tiercache: the layerwise TieredKVConnector."""
