"""KV cache events for what the store's tiers hold: the ledger, the tracker that decides when, the journal."""
