"""The Redis tier's config: `RedisTierConfig`, parsed from one ``{"kind": "redis", ...}`` item.

Why beside `redis_tier.py` and not in it: that module imports redis-py and torch at import time, and
importing a config must not. Only validating a redis tier's ``url`` imports ``redis.connection`` (inside
`check_redis_url`), so a bad URL is a ConfigError when the config is read, not when the engine starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm_tiercache.shared.store.tier_config import (
    as_number,
    as_str,
    check_keys,
    check_policy,
    invalid,
    parse_size,
)

REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")
DEFAULT_PART_SIZE = 8 << 20


@dataclass(frozen=True)
class RedisTierConfig:
    """A Redis server or cluster shared by every process and host that can reach it."""

    #: keys a ``tiers[i]`` item of this kind may have, besides ``ssl_*`` (redis-py TLS options)
    FIELDS: ClassVar[tuple[str, ...]] = ("kind", "url", "password", "ttl_s", "part_size", "timeout_s",
                                         "retry_after_s", "key_prefix", "policy")
    #: a shared tier keeps LRU (an in-process frequency sketch cannot see the other processes' accesses)
    POLICIES: ClassVar[tuple[str, ...]] = ("lru",)

    url: str = ""
    password: str | None = None
    ttl_s: float | None = None
    part_size: int = DEFAULT_PART_SIZE
    timeout_s: float = 2.0
    retry_after_s: float = 5.0
    key_prefix: str = "tiercache:"
    ssl: Mapping[str, Any] = field(default_factory=dict)
    policy: str = "lru"
    kind: str = "redis"

    @property
    def cluster(self) -> bool:
        return "+cluster://" in self.url

    @property
    def address(self) -> str:
        """The URL without credentials, for log lines."""
        return re.sub(r"//[^@/]*@", "//", self.url)

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str) -> RedisTierConfig:
        """Validate ``raw``: ``url`` is required; ``ssl_*`` keys only with a rediss:// URL."""
        check_keys(raw, path, cls.kind, cls.FIELDS, prefix="ssl_", prefix_hint=", ssl_* (redis-py TLS options)")
        policy = check_policy(raw, path, cls.POLICIES)
        url = raw.get("url")
        if not isinstance(url, str) or not url.startswith(REDIS_SCHEMES):
            raise invalid(f"{path}.url", url, "a URL starting with " + ", ".join(REDIS_SCHEMES))
        check_redis_url(url, f"{path}.url")
        part_size = parse_size(raw.get("part_size", DEFAULT_PART_SIZE), f"{path}.part_size")
        if part_size < 1024:
            raise invalid(f"{path}.part_size", raw.get("part_size"), "a size of at least 1KiB")
        ssl = {k: v for k, v in raw.items() if k.startswith("ssl_")}
        if ssl and not url.startswith("rediss"):
            first = sorted(ssl)[0]
            raise invalid(f"{path}.{first}", ssl[first], "ssl_* options only with a rediss:// URL")
        return cls(
            url=url,
            password=as_str(raw.get("password"), f"{path}.password", optional=True),
            ttl_s=as_number(raw.get("ttl_s"), f"{path}.ttl_s", optional=True),
            part_size=part_size,
            timeout_s=as_number(raw.get("timeout_s", 2.0), f"{path}.timeout_s"),  # type: ignore[arg-type]
            retry_after_s=as_number(raw.get("retry_after_s", 5.0), f"{path}.retry_after_s",  # type: ignore[arg-type]
                                    positive=False),
            key_prefix=as_str(raw.get("key_prefix", "tiercache:"), f"{path}.key_prefix"),  # type: ignore[arg-type]
            ssl=ssl,
            policy=policy,
        )


def check_redis_url(url: str, path: str) -> None:
    """Parse the URL as redis-py will (port, query options), so a bad one is a ConfigError here and not
    a ValueError out of the tier's constructor when the engine starts."""
    from redis.connection import parse_url

    try:
        parse_url(url.replace("+cluster://", "://", 1))
    except (ValueError, TypeError) as exc:
        shown = re.sub(r"//[^@/]*@", "//***@", url)  # never echo a password into a log
        raise invalid(path, shown, f"a URL redis-py can parse, scheme://[user:password@]host[:port 0-65535][/db] "
                                   f"({exc})") from exc
