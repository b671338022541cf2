"""`tiercache bench trace`: a production KV trace (Mooncake format) replayed through the store's real tiers."""
