"""A far store never stalls the scheduler: lookups off its thread, chunks in host memory before the request's turn.

`probe`: the lookups' threads, which ask the tiers one record per chunk; `far`: each request's lookup
from its arrival to its answer, and the chunks fetched ahead (docs/architecture.md, "far tiers").
"""
