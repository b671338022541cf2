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
#: Bounds of the sizes and durations. A part is one Redis string (at most 512 MB); a TTL becomes whole
#: milliseconds (PX), so less than 1 ms would be 0 and Redis would refuse every write; a socket timeout
#: or a retry pause beyond these is a typo, not a setting (a request would wait that long on a cache).
MIN_PART_SIZE, MAX_PART_SIZE = 1 << 10, 512 << 20
MIN_TTL_S, MAX_TTL_S = 0.001, 365 * 86400.0
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 300.0
MAX_RETRY_AFTER_S = 3600.0


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
        ssl_keys = redis_ssl_options() if any(str(k).startswith("ssl_") for k in raw) else None
        hint = f", ssl_* (redis-py TLS options{': ' + ', '.join(ssl_keys) if ssl_keys else ''})"
        check_keys(raw, path, cls.kind, cls.FIELDS, prefix="ssl_", prefix_hint=hint, prefixed=ssl_keys)
        policy = check_policy(raw, path, cls.POLICIES)
        url = raw.get("url")
        if not isinstance(url, str) or not url.startswith(REDIS_SCHEMES):
            raise invalid(f"{path}.url", url, "a URL starting with " + ", ".join(REDIS_SCHEMES))
        check_redis_url(url, f"{path}.url")
        part_size = parse_size(raw.get("part_size", DEFAULT_PART_SIZE), f"{path}.part_size")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise invalid(f"{path}.part_size", raw.get("part_size"),
                          "a size of at least 1KiB and at most 512MiB (Redis's largest string)")
        ssl = {k: v for k, v in raw.items() if k.startswith("ssl_")}
        if ssl and not url.startswith("rediss"):
            first = sorted(ssl)[0]
            raise invalid(f"{path}.{first}", ssl[first], "ssl_* options only with a rediss:// URL")
        return cls(
            url=url,
            password=as_str(raw.get("password"), f"{path}.password", optional=True),
            ttl_s=as_number(raw.get("ttl_s"), f"{path}.ttl_s", optional=True, minimum=MIN_TTL_S,
                            maximum=MAX_TTL_S, null_means="no expiry"),
            part_size=part_size,
            timeout_s=as_number(raw.get("timeout_s", 2.0), f"{path}.timeout_s",  # type: ignore[arg-type]
                                minimum=MIN_TIMEOUT_S, maximum=MAX_TIMEOUT_S),
            retry_after_s=as_number(raw.get("retry_after_s", 5.0), f"{path}.retry_after_s",  # type: ignore[arg-type]
                                    positive=False, maximum=MAX_RETRY_AFTER_S),
            key_prefix=as_str(raw.get("key_prefix", "tiercache:"), f"{path}.key_prefix"),  # type: ignore[arg-type]
            ssl=ssl,
            policy=policy,
        )


def redis_ssl_options() -> tuple[str, ...] | None:
    """The ``ssl_*`` keyword arguments the installed redis-py accepts (its `SSLConnection`), so a typo such
    as ``ssl_ca_cert`` is a ConfigError here, not a TypeError each time the tier connects (the tier would
    stay down without a clear cause). None when redis-py cannot tell: every ``ssl_*`` key is then passed."""
    import inspect

    try:
        from redis.connection import SSLConnection

        names = tuple(p for p in inspect.signature(SSLConnection.__init__).parameters if p.startswith("ssl_"))
    except (ImportError, TypeError, ValueError):  # pragma: no cover - another redis-py layout
        return None
    return names or None


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
