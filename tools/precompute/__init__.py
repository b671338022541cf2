"""Offline precompute jobs: encoder outputs of images (`ec`), prefix KV of documents (`kv`)."""
