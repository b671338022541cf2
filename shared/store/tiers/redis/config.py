"""The Redis tier's config: `RedisTierConfig`, parsed from one ``{"kind": "redis", ...}`` item.

Why beside `tier.py` and not in it: that module imports redis-py and torch at import time, and
importing a config must not. Only validating a redis tier's ``url`` imports ``redis.connection`` (inside
`check_redis_url`), so a bad URL is a ConfigError when the config is read, not when the engine starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, Strict

from vllm_tiercache.shared.store.admission_config import WRITE_THROUGH, AdmissionConfig, check_admission
from vllm_tiercache.shared.store.tier_config import (
    Allowed,
    OptionalText,
    PinBudget,
    Text,
    check_keys,
    fail,
    invalid,
    schema_extra,
    seconds,
    section_keys,
    size,
    validate,
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
_URL_ALLOWED = "a URL starting with " + ", ".join(REDIS_SCHEMES)
_URL_PATTERN = "^(" + "|".join(re.escape(scheme[:-3]) for scheme in REDIS_SCHEMES) + ")://"
_PARSE_ALLOWED = ("a URL redis-py can parse, scheme://[user:password@]host[:port 0-65535][/db], a cluster's with "
                  "several seed nodes host[:port],host[:port],... ({})")


def _masked(url: str) -> str:
    """The URL with its password (in the authority or as a ``?password=`` query) masked: never echo a
    password into a log or an error."""
    url = re.sub(r"//[^@/]*@", "//***@", url)
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)


def _check_url(url: str) -> str:
    if not url.startswith(REDIS_SCHEMES):
        raise fail(_URL_ALLOWED, shown=_masked(url))
    why = _parse_error(url)
    if why is not None:
        raise fail(_PARSE_ALLOWED.format(why), shown=_masked(url))
    return url


@dataclass(frozen=True)
class RedisTierConfig:
    """A Redis server or cluster shared by every process and host that can reach it (`kind: redis`).
    Besides these keys, the ``ssl_*`` keyword arguments of the installed redis-py's SSLConnection
    (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``, ``ssl_check_hostname``, ...)
    are passed through for TLS, only with a rediss:// URL; a misspelt one is an error, not a failure at
    every connect."""

    __pydantic_config__ = ConfigDict(extra="forbid", json_schema_extra=schema_extra(
        drop=("ssl",), required=("url",), patternProperties={"^ssl_": {"description": "a redis-py TLS option"}}))
    #: a shared tier keeps LRU (an in-process frequency sketch cannot see the other processes' accesses)
    POLICIES: ClassVar[tuple[str, ...]] = ("lru",)

    url: Annotated[str, Strict(), AfterValidator(_check_url), Allowed(_URL_ALLOWED), Field(
        json_schema_extra={"pattern": _URL_PATTERN},
        description="The server: redis://, rediss:// (TLS), redis+cluster:// or rediss+cluster://, then "
                    "[user:password@]host[:port][/db], parsed as redis-py will. A cluster's may name several seed "
                    "nodes, host[:port],host[:port],...: the client learns the cluster from the first that "
                    "answers (with one, a process that starts while that node hangs or is gone never reaches the "
                    "cluster until it answers again).")] = ""
    password: Annotated[OptionalText, Field(description="Password, unless the URL holds it.")] = None
    ttl_s: Annotated[seconds(minimum=MIN_TTL_S, maximum=MAX_TTL_S, optional=True, null_means="no expiry"), Field(
        description="Seconds a record lives (at most 365 days); null: no expiry. Sent in whole milliseconds: "
                    "below 1 ms it would be 0, and Redis would refuse every write.")] = None
    part_size: Annotated[size(MIN_PART_SIZE, MAX_PART_SIZE, "a size of at least 1KiB and at most 512MiB (Redis's "
                                                             "largest string)"), Field(
        description="Records larger than this are split into parts of this size (512 MB is Redis's largest "
                    "string).")] = DEFAULT_PART_SIZE
    timeout_s: Annotated[seconds(minimum=MIN_TIMEOUT_S, maximum=MAX_TIMEOUT_S), Field(
        description="Socket timeout in seconds: a worker's load or save waits that long (twice, with the one "
                    "retry) on an unresponsive server; a scheduler's lookup waits at most lookup_budget_ms.")] = 2.0
    retry_after_s: Annotated[seconds(positive=False, maximum=MAX_RETRY_AFTER_S), Field(
        description="Seconds between two probes (PING) of a down server by a background thread; requests "
                    "never probe.")] = 5.0
    key_prefix: Annotated[Text, Field(description="Prefix of every Redis key the tier writes.")] = "tiercache:"
    ssl: Mapping[str, Any] = field(default_factory=dict)
    policy: Annotated[Literal["lru"], Field(
        description="Eviction policy: lru only (a shared tier; Redis evicts by its own maxmemory policy "
                    "too).")] = "lru"
    pin_budget: PinBudget = 0.0
    admission: Annotated[AdmissionConfig, Field(description=(
        "Which puts are written to this tier: {\"policy\": \"always\"} (default), {\"policy\": \"seen\", "
        "\"min_seen\": 2} or {\"policy\": \"evicted\"} (exclusive of the memory tier); see its table below "
        "(default: write-through)."))] = WRITE_THROUGH
    kind: Annotated[Literal["redis"], Field(description="The tier kind.")] = "redis"

    @property
    def cluster(self) -> bool:
        return "+cluster://" in self.url

    @property
    def address(self) -> str:
        """The URL without credentials or query (redis-py takes ``?password=`` too), for log lines."""
        return re.sub(r"//[^@/]*@", "//", self.url).split("?", 1)[0]

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str) -> RedisTierConfig:
        """Validate one ``tiers[i]`` item: ``url`` is required; ``ssl_*`` keys only with a rediss:// URL."""
        ssl_keys = redis_ssl_options() if any(str(k).startswith("ssl_") for k in raw) else None
        hint = f", ssl_* (redis-py TLS options{': ' + ', '.join(ssl_keys) if ssl_keys else ''})"
        check_keys(raw, path, cls.kind, section_keys(cls, exclude=("ssl",)), prefix="ssl_", prefix_hint=hint,
                   prefixed=ssl_keys)
        check_admission(raw, path)
        ssl = {k: v for k, v in raw.items() if k.startswith("ssl_")}
        fields = {k: v for k, v in raw.items() if k not in ssl}
        # a missing url is reported as null (the dataclass defaults it only for direct construction)
        config = validate(cls, {"url": None, **fields, "ssl": ssl}, path)
        if ssl and not config.url.startswith("rediss"):
            first = sorted(ssl)[0]
            raise invalid(f"{path}.{first}", ssl[first], "ssl_* options only with a rediss:// URL")
        return config


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
    why = _parse_error(url)
    if why is not None:
        raise invalid(path, _masked(url), _PARSE_ALLOWED.format(why))


def _parse_error(url: str) -> str | None:
    """Why redis-py cannot parse ``url`` (a cluster's: with each of its seed nodes), or None."""
    from redis.connection import parse_url

    seeds = seed_urls(url)
    cluster = "+cluster://" in url
    if len(seeds) > 1 and not cluster:
        return "several hosts only in a redis+cluster:// or rediss+cluster:// URL"
    try:
        for seed in seeds:
            parsed = parse_url(seed)
            if len(seeds) > 1 and not parsed.get("host"):  # (one host left out means localhost, as redis-py says)
                return "an empty seed node in the list"
            if any(c.isspace() for c in str(parsed.get("host", ""))):
                return f"a space in the host {str(parsed.get('host')).strip()!r}: list seed nodes as a:7000,b:7000"
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def seed_urls(url: str) -> list[str]:
    """``url`` once per host of its authority, as redis-py's ``from_url`` takes it (without ``+cluster``):
    ``redis+cluster://u:p@a:7000,b:7001/0`` -> ``redis://u:p@a:7000/0``, ``redis://u:p@b:7001/0``.

    Why several: a cluster client learns the cluster's nodes from the first seed node that answers; with one
    seed, a process that starts while that node hangs (or is gone, its slots failed over to a replica) never
    reaches the cluster until the node answers again, while the cluster serves."""
    plain = url.replace("+cluster://", "://", 1)
    scheme, sep, rest = plain.partition("://")
    if not sep:
        return [url]
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hosts = authority.rpartition("@")
    return [f"{scheme}://{userinfo}{at}{host}{tail}" for host in hosts.split(",")]
