"""Prefill/decode hand-off through the store: the producer's promise and the consumer's bounded wait."""
