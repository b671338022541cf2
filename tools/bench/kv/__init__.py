"""`tiercache bench kv` and `bench kv-step`: a hit's time to first token per tier, and the connector's cost per step."""
