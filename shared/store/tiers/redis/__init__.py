"""Redis tier: records in a Redis server or cluster, shared by every process and host that reaches it."""
