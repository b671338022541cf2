"""Sealing at rest: records that leave the process (disk, GDS, Redis, any future shared tier) are
encrypted with AES-256-GCM under a per-tenant subkey of a key ring; see `sealer` and docs/reliability.md."""
