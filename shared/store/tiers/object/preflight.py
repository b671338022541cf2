"""The object tier's check before an engine starts: one HEAD of the bucket with this process's credentials.

Why at preflight (`vllm_tiercache.preflight`): a bucket name with a typo or credentials the store refuses
would otherwise give a tier that stays down for ever, found only by reading its warning after the model
loaded. These are settings, so they stop the start with one line naming the setting. An endpoint that does
not answer at all is not a setting one can tell wrong from here (the store may be coming up): a warning, and
the tier starts down and is probed. No secret is ever part of the message: only where the chain found the
credentials (``env``, ``shared-credentials-file``, ``iam-role``, ...).
"""

from __future__ import annotations

import logging

from vllm_tiercache.shared.store.tier_config import ConfigError
from vllm_tiercache.shared.store.tiers.object.client import (
    DOWN,
    MISSING,
    THROTTLED,
    classify,
    describe_attempt,
    error_code,
    make_client,
)
from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig

log = logging.getLogger(__name__)
#: The longest a preflight HEAD waits (a tier's own ``timeout_s`` when shorter).
PREFLIGHT_TIMEOUT_S = 5.0
_CREDENTIALS = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the instance or container role "
                "(never the store config)")


def check_bucket(config: ObjectTierConfig, path: str) -> None:
    """Raise `ConfigError` for a missing bucket or refused credentials; warn when the endpoint is away."""
    from dataclasses import replace

    quick = replace(config, timeout_s=min(config.timeout_s, PREFLIGHT_TIMEOUT_S), concurrency=1)
    client = make_client(quick)
    try:
        client.head_bucket(Bucket=config.bucket)
    except Exception as exc:
        kind, code = classify(exc), error_code(exc)
        where = config.endpoint or "AWS S3"
        if kind == MISSING or code in ("NoSuchBucket", "404"):
            raise ConfigError(f"{path}.bucket: bucket {config.bucket!r} does not exist at {where}; create it, or "
                              f"set {path}.bucket to an existing bucket (and {path}.endpoint / {path}.region to "
                              "where it lives)") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                    "InvalidToken") or type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            raise ConfigError(f"{path}: the AWS credentials of this process are refused for bucket {config.bucket!r} "
                              f"at {where} ({code or type(exc).__name__}; tried: {describe_attempt(config, client)}); "
                              f"set {_CREDENTIALS}") from None
        if kind == DOWN:
            log.warning("vllm-tiercache: %s: the object tier's endpoint %s does not answer (%s); the engine starts "
                        "without it and serves requests, and the tier is probed every %.1fs", path, where,
                        type(exc).__name__, config.retry_after_s)
            return
        if kind == THROTTLED:  # it answered, and asks to be called less often: a busy store, not a wrong setting
            log.warning("vllm-tiercache: %s: the object tier's endpoint %s asks to slow down (%s) at start; the "
                        "engine starts and the tier backs off", path, where, code)
            return
        raise ConfigError(f"{path}: bucket {config.bucket!r} at {where} refused a HEAD ({code or type(exc).__name__});"
                          f" check {path}.endpoint, {path}.region and {path}.path_style") from None
    finally:
        client.close()
