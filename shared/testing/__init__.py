"""Helpers for tests and tools that need real services (a real redis-server, not a mock)."""

from shared.testing.redis_server import RedisServer, RedisServerError, find_redis_server

__all__ = ["RedisServer", "RedisServerError", "find_redis_server"]
