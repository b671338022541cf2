"""Tools on top of both connectors: the `tiercache` CLI, offline jobs, benchmarks, the demo, tiny models."""
