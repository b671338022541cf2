"""The object tier's S3 client: boto3, tuned for many requests in flight, and what a failure means.

Why boto3 and not obstore, awscrt or aiobotocore: measured on this project's 2-core machines against a
local SeaweedFS (32 GETs of 1 MiB), boto3 called one at a time read 467 MiB/s, the same client called from
16 threads 779 MiB/s (1.67x), obstore's async API used naively 176 MiB/s. The tier's callers are threads
(the worker's loader, the store's writer, the scheduler's bounded lookup), not an event loop, so a pool of
threads over one thread-safe boto3 client, with as many pooled connections as threads, puts the requests in
flight with no loop to hop onto and off; its CPU cost is mostly botocore's request signing, paid in threads
that release the GIL while they wait on the socket. boto3 also brings what operators expect of an AWS client
and must not be reimplemented: the standard credential chain (environment, profile, SSO, container and
instance roles, with refresh), path-style and virtual-hosted addressing, custom CA bundles, every region.
`tiercache bench tiers` measures the tier against the same client's raw GETs and PUTs at the same
concurrency, and against boto3 one request at a time. The hot requests (a record's GET and PUT, a lookup's
HEAD) use this client to presign and its HTTP session to send, without its per-call work (`direct` says why).

Tuning: ``max_pool_connections`` = the tier's ``concurrency`` (+2 for the prober and the janitor), no retries
inside botocore (one timeout is all a call may cost: the tier marks itself down instead of retrying), and
no extra CRC on PUT or GET (botocore >= 1.36 adds one by default; records carry their own checksums, and some
S3-compatible stores refuse the new headers), and timestamps parsed by `parse_timestamp`: botocore's own parser
(dateutil) took 94 us per timestamp here, more than half of a sweep's CPU, since a listing has one per object
(``tiercache bench trace --object-bucket`` found it: 2,000 records listed, 0.6 s a sweep).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import boto3
import botocore.exceptions
import botocore.session
from botocore.config import Config
from botocore.utils import parse_timestamp as botocore_timestamp

from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig

#: Every line of the object tier is logged under this one name, whichever of its modules writes it.
log = logging.getLogger("vllm_tiercache.shared.store.tiers.object.tier")

DOWN, MISSING, CONFLICT, ERROR, BUG = "down", "missing", "conflict", "error", "bug"
THROTTLED = "throttled"
#: Error codes that say this tier cannot work at all with these settings now: the bucket is gone or the
#: credentials are refused. The tier goes down (misses, skipped writes) and the prober finds it back when
#: an operator fixed it; preflight names the setting before an engine starts.
_TIER_CODES = frozenset({"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                         "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled",
                         "AuthorizationHeaderMalformed", "PermanentRedirect"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_CONFLICT_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
#: Answers that ask the client to call less often (S3's 503 SlowDown, and what S3-compatible stores and
#: gateways answer instead): back off and try again, never "down".
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                             "TooManyRequests", "TooManyRequestsException", "RequestThrottled",
                             "ServiceUnavailable", "503", "429"})
_THROTTLE_STATUS = frozenset({429, 503})
#: Pooled connections beyond the request threads: the prober and the janitor.
EXTRA_CONNECTIONS = 2


def make_client(config: ObjectTierConfig) -> Any:
    """A boto3 S3 client for ``config``; credentials from the standard AWS chain (never from the config).

    Builds no connection: the first request does."""
    core = botocore.session.get_session()  # a new botocore session: its parser defaults are this client's alone
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
    session = boto3.session.Session(botocore_session=core)
    s3: dict[str, Any] = {"addressing_style": "path" if config.path_style else "auto"}
    tuned = Config(
        region_name=config.region or session.region_name or "us-east-1",
        # said, not left to botocore: it presigns S3 URLs (the tier's GETs, HEADs and PUTs, `direct`) with
        # SigV2 unless told, which AWS refuses in the regions opened since 2014 and for buckets made since 2020
        signature_version="s3v4",
        connect_timeout=config.timeout_s, read_timeout=config.timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=config.concurrency + EXTRA_CONNECTIONS, tcp_keepalive=True, s3=s3,
        **_no_extra_checksums())
    return session.client("s3", endpoint_url=config.endpoint, verify=config.ca_bundle or None, config=tuned)


def parse_timestamp(value: Any) -> datetime:
    """A response's timestamp as botocore's parser gives it (an aware datetime), ISO 8601 the fast way: S3's
    listings give ``2026-01-31T12:34:56.000Z``, one per object (module docstring: a sweep's CPU). Anything
    else (an HTTP date in a header, epoch seconds, other digits) goes to botocore's parser."""
    if isinstance(value, str) and len(value) > 19 and value[10:11] == "T":
        try:
            parsed = datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
        except ValueError:
            parsed = None
        if parsed is not None and parsed.tzinfo is not None:
            return parsed
    return botocore_timestamp(value)


def _no_extra_checksums() -> dict[str, str]:
    """botocore's switches for its default CRC on PUT and GET (1.36+), off where this botocore has them."""
    try:
        Config(request_checksum_calculation="when_required")
    except TypeError:  # an older botocore: it adds none anyway
        return {}
    return {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}


def describe_attempt(config: ObjectTierConfig, client: Any) -> str:
    """What a request does, in words, for the 'unreachable' line: endpoint, addressing, CA, region and where
    the credentials come from (the chain's method name, e.g. ``env`` or ``iam-role``), never a secret.

    The credentials are the ones ``client`` resolved when it was built: walking the chain again here could
    ask the instance metadata service, which on a host outside AWS costs seconds on the thread that failed."""
    try:
        creds = client._request_signer._credentials  # botocore's own, resolved with the client
        source = f"credentials from {creds.method}" if creds is not None else "no credentials found in the AWS chain"
    except Exception:  # another botocore layout: say nothing of them rather than guess
        source = "credentials from the AWS chain"
    return (f"{config.endpoint or 'AWS S3'}, bucket {config.bucket}, region {client.meta.region_name}, "
            f"{'path-style' if config.path_style else 'virtual-hosted'} addressing, "
            f"{'CA bundle ' + config.ca_bundle if config.ca_bundle else 'system CAs'}, {source}, "
            f"timeout {config.timeout_s:g}s")


def error_code(exc: BaseException) -> str:
    """The S3 error code of a ClientError (``NoSuchKey``, ``403``, ...); ``""`` for any other exception."""
    if isinstance(exc, botocore.exceptions.ClientError):
        err = exc.response.get("Error", {})
        return str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


def status_of(exc: BaseException) -> int:
    """The HTTP status of a ClientError; 0 for any other exception."""
    if isinstance(exc, botocore.exceptions.ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return 0


def classify(exc: BaseException) -> str:
    """What an exception out of a boto3 call means, the one place that decides it:

    - ``missing``: no such object (a miss, nothing wrong);
    - ``conflict``: a conditional request lost (another writer won: the janitor's lock, a control update);
    - ``down``: the endpoint is not there or hangs (connection refused or reset, a timeout), the bucket is
      gone, or the credentials are refused or missing: the whole tier goes down and the prober retries
      every ``retry_after_s``;
    - ``throttled``: the store asked to be called less often (503 SlowDown, 429): that record only, a miss
      or a write a patient writer puts again after a backoff (`vllm_tiercache.shared.store.writes.patience`); the
      store answered, so it is up;
    - ``error``: the store answered one request with an error (a 4xx about that request, another 5xx:
      S3 says to retry those, and SeaweedFS answers a GET or conditional PUT that races an overwrite of the
      same name with 500): that record only, a miss or a dropped write; the store answered, so it is up;
    - ``bug``: anything else (logged once with its traceback).
    """
    if isinstance(exc, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
                        botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                        botocore.exceptions.CredentialRetrievalError, OSError)):
        return DOWN
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = error_code(exc), status_of(exc)
        if code in _MISSING_CODES:
            return MISSING
        if code in _CONFLICT_CODES:
            return CONFLICT
        if code in _TIER_CODES or status == 403:
            return DOWN
        if code in _THROTTLE_CODES or status in _THROTTLE_STATUS:
            return THROTTLED
        return ERROR
    if isinstance(exc, botocore.exceptions.BotoCoreError):
        return ERROR
    return BUG
