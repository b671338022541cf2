"""The object tier's config: `ObjectTierConfig`, parsed from one ``{"kind": "object", ...}`` item.

Why beside `tier.py` and not in it: that module imports boto3 and torch, and reading a config must not.

What is not here, on purpose: credentials. The tier takes them from the standard AWS chain (environment
variables, ``AWS_PROFILE`` and the shared files, a container or instance role), as every AWS tool does, so a
secret never sits in a store config that is logged, hashed into a cache key or shown by ``tiercache config``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, Strict

from vllm_tiercache.shared.store.admission_config import WRITE_THROUGH, AdmissionConfig, check_admission
from vllm_tiercache.shared.store.tier_config import (
    Allowed,
    Bool,
    Capacity,
    OptionalText,
    PinBudget,
    Text,
    check_keys,
    fail,
    schema_extra,
    seconds,
    section_keys,
    size,
    validate,
)

DEFAULT_OBJECT_CAPACITY = 1 << 40
#: ``sweep_share``: its default and its bound (all grants together at most half of capacity)
DEFAULT_SWEEP_SHARE, MAX_SWEEP_SHARE = 0.02, 0.5
#: ``sweep_every_s``: its default and its range, seconds
DEFAULT_SWEEP_EVERY_S, SWEEP_EVERY_S_RANGE = 30.0, (0.05, 86400.0)
#: S3's bucket-name rule (3 to 63 lower-case letters, digits, dots and hyphens, a letter or digit at each end).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKET_ALLOWED = ("an S3 bucket name: 3 to 63 lower-case letters, digits, dots and hyphens, starting and ending "
                   "with a letter or digit")
_ENDPOINT_ALLOWED = "an http:// or https:// URL without user, password or query, e.g. https://s3.us-east-1.amazonaws.com"
_PREFIX_ALLOWED = "a key prefix of printable characters without a leading '/', ending in '/', e.g. tiercache/"
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.01, 300.0
MAX_RETRY_AFTER_S = 3600.0
MIN_CONCURRENCY, MAX_CONCURRENCY = 1, 256
#: S3's largest object: a ``range_size`` this large reads every record in one plain GET.
MAX_RANGE = 5 << 30
#: the largest ``half_life``, in turnovers (the disk tier's bound: beyond it the order is LFU)
MAX_HALF_LIFE = 1000.0


def _check_bucket(bucket: str) -> str:
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise fail(_BUCKET_ALLOWED)
    return bucket


def _check_endpoint(url: str | None) -> str | None:
    if url is None:
        return None
    if not re.match(r"^https?://[^/@?#\s]+(/[^?#@\s]*)?$", url):
        raise fail(_ENDPOINT_ALLOWED, shown=re.sub(r"//[^@/]*@", "//***@", url))
    return url.rstrip("/")


def _check_prefix(prefix: str) -> str:
    if prefix.startswith("/") or not prefix.endswith("/") or any(not ch.isprintable() for ch in prefix):
        raise fail(_PREFIX_ALLOWED)
    return prefix


@dataclass(frozen=True)
class ObjectTierConfig:
    """An S3 bucket (AWS S3, MinIO, Ceph RGW, SeaweedFS, ...) shared by every process and host that reaches
    it (`kind: object`). Credentials come from the standard AWS chain (environment, profile, instance role),
    never from this config."""

    __pydantic_config__ = ConfigDict(extra="forbid", json_schema_extra=schema_extra(required=("bucket",)))
    #: the orders a sweep can rank by from every writer's usage ledger (`janitor`, `order`): an in-process
    #: frequency sketch (``wtinylfu``) cannot see the other writers' accesses
    POLICIES: ClassVar[tuple[str, ...]] = ("lru", "prefix")

    bucket: Annotated[str, Strict(), AfterValidator(_check_bucket), Allowed(_BUCKET_ALLOWED), Field(
        description="The bucket; it must exist (preflight says so when it does not).")] = ""
    endpoint: Annotated[OptionalText, AfterValidator(_check_endpoint), Allowed(_ENDPOINT_ALLOWED), Field(
        description="The S3 endpoint URL (MinIO, Ceph RGW, SeaweedFS, a VPC endpoint); null: AWS S3 of the "
                    "region, or $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL as boto3 reads them.")] = None
    prefix: Annotated[Text, AfterValidator(_check_prefix), Allowed(_PREFIX_ALLOWED), Field(
        description="Prefix of every object the tier writes; tiers (or deployments) sharing a bucket use "
                    "different prefixes, and capacity counts only this prefix.")] = "tiercache/"
    region: Annotated[OptionalText, Field(
        description="The region; null: the AWS chain's ($AWS_REGION, the profile), else us-east-1.")] = None
    path_style: Annotated[Bool, Field(
        description="Path-style addressing (endpoint/bucket/key), which MinIO, Ceph RGW and SeaweedFS behind a "
                    "plain host name need; false: virtual-hosted (bucket.endpoint/key), AWS's default.")] = False
    ca_bundle: Annotated[OptionalText, Field(
        description="A PEM file of the CA certificates an https endpoint is checked against (a private CA); "
                    "null: the system's and certifi's.")] = None
    capacity: Annotated[Capacity, Field(
        description="Bytes the tier may hold under its prefix, across every writer on every host: the "
                    "janitor (one writer at a time, elected by a conditional PUT) deletes records in the "
                    "order of policy down to capacity less what the active writers may write before the next "
                    "sweep, and each writer writes only within that grant, so usage stays at most capacity. "
                    "Default 1TiB.")] = DEFAULT_OBJECT_CAPACITY
    sweep_every_s: Annotated[seconds(minimum=SWEEP_EVERY_S_RANGE[0], maximum=SWEEP_EVERY_S_RANGE[1]), Field(
        description="Seconds between two capacity sweeps of a writer's janitor (none when another writer swept "
                    "within it); a writer that wrote half its grant (sweep_share) sweeps sooner. A writer whose "
                    "usage ledger is older than max(60, 4 x this) seconds gets no grant.")] = DEFAULT_SWEEP_EVERY_S
    sweep_share: Annotated[float, Strict(), Field(gt=0.0, le=MAX_SWEEP_SHARE, allow_inf_nan=False, description=(
        "Each active writer's grant, as a share of capacity: what it may write between two sweeps (at least "
        "two of the largest records; all grants together at most half of capacity). A sweep evicts down to "
        "capacity less the grants, so usage runs between that and capacity: larger means fewer sweeps "
        "(listings), smaller keeps usage nearer capacity.")),
        Allowed(f"a share of capacity above 0 and at most {MAX_SWEEP_SHARE}, e.g. 0.02")] = DEFAULT_SWEEP_SHARE
    range_size: Annotated[size(64 << 10, MAX_RANGE, "a size from 64KiB to 5GiB"), Field(
        description="A record larger than this is read in ranged GETs of this size, all in flight together; "
                    "smaller ones in one GET. Default 5GiB (S3's largest object): every record in one GET, "
                    "which measured faster against a local SeaweedFS on 2 cores (16 MiB records: 628 MiB/s "
                    "whole, 322 MiB/s in 2 MiB ranges); try 8MiB where one connection is slower than the "
                    "link (cross-region, a single-stream-limited endpoint). Writes are always one PUT of the "
                    "whole record (the commit).")] = MAX_RANGE
    concurrency: Annotated[int, Strict(), Field(ge=MIN_CONCURRENCY, le=MAX_CONCURRENCY, description=(
        "Requests in flight at once per process (one thread each, one pooled connection each).")),
        Allowed(f"an int from {MIN_CONCURRENCY} to {MAX_CONCURRENCY}")] = 16
    timeout_s: Annotated[seconds(minimum=MIN_TIMEOUT_S, maximum=MAX_TIMEOUT_S), Field(
        description="Seconds one request may wait to connect, and for each read of its answer; a request "
                    "past it marks the tier down (misses, skipped writes) until the prober finds the "
                    "endpoint back. A scheduler's lookup waits at most lookup_budget_ms.")] = 5.0
    retry_after_s: Annotated[seconds(positive=False, maximum=MAX_RETRY_AFTER_S), Field(
        description="Seconds between two probes (HEAD of the bucket) of a down endpoint by a background "
                    "thread; requests never probe.")] = 5.0
    policy: Annotated[Literal["lru", "prefix"], Field(
        description="Eviction policy of the janitor's sweeps, ranked from every writer's usage ledger: prefix "
                    "(the default: decayed access counts, LRFU, a record known only by its write counting a "
                    "tenth of an access, no parent evicted before its children; the disk tier's prefix order, "
                    "computed at each sweep) or lru (least recently used). A record's last use is the newest "
                    "of its write and the reads the ledgers report. Pins are kept either way.")] = "prefix"
    half_life: Annotated[float, Strict(), Field(gt=0.0, le=MAX_HALF_LIFE, allow_inf_nan=False, description=(
        "With policy prefix: how fast an access's weight halves, in turnovers of the tier (the time the "
        "writers take to write one capacity, measured between sweeps: about the time a record takes to age "
        "out by recency). Small is LRU, large is LFU; on the Mooncake trace 0.5 and 1.0 (the default) "
        f"measured alike, 2 and 4 lower. At most {MAX_HALF_LIFE:g}.")),
        Allowed(f"a positive number of turnovers, at most {MAX_HALF_LIFE:g}, e.g. 1.0")] = 1.0
    pin_budget: PinBudget = 0.0
    admission: Annotated[AdmissionConfig, Field(description=(
        "Which puts are written to this tier: {\"policy\": \"always\"} (default), {\"policy\": \"seen\", "
        "\"min_seen\": 2} or {\"policy\": \"evicted\"} (exclusive of the memory tier); see its table below "
        "(default: write-through)."))] = WRITE_THROUGH
    layout: Annotated[Literal["chunk", "record"], Field(description=(
        "How records lie in objects. chunk (the default): a KV chunk's layer records written together go "
        "into one object, so a chunk costs one PUT, one GET and one HEAD instead of one per layer; other "
        "records (encoder outputs, journals) one object each. record: one object per record, the layout of "
        "earlier builds; use it for a bucket shared with them or holding a corpus they wrote (each layout "
        "reads the other's KV records as misses, never as damage)."))] = "chunk"
    kind: Annotated[Literal["object"], Field(description="The tier kind.")] = "object"

    @property
    def address(self) -> str:
        """Where the tier lives, for log lines: endpoint (or "s3") and bucket/prefix, never a credential."""
        return f"{self.endpoint or 's3'}/{self.bucket}/{self.prefix}"

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str) -> ObjectTierConfig:
        """Validate one ``tiers[i]`` item: ``bucket`` is required."""
        check_keys(raw, path, cls.kind, section_keys(cls))
        check_admission(raw, path)
        return validate(cls, {"bucket": None, **raw}, path)
