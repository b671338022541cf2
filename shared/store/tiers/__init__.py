"""The store's tier kinds, one folder each: its tier, its config model, its parts and its admin side.

Each kind is registered by dotted path in `vllm_tiercache.shared.store.registry`; nothing is imported here,
so reading a config imports no backend."""
