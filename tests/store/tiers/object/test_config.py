"""The object tier's config: what it takes, what it refuses, and that no credential has a place in it."""

from __future__ import annotations

import pytest

from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig


def _tier(**fields):
    return StoreConfig.load({"tiers": [{"kind": "object", **fields}]}).tiers[0]


def test_defaults_and_fields():
    cfg = _tier(bucket="corpus", endpoint="https://minio.local:9000/", path_style=True, ca_bundle="/ca.pem",
                capacity="2GiB", prefix="team-a/")
    assert isinstance(cfg, ObjectTierConfig)
    assert cfg.endpoint == "https://minio.local:9000" and cfg.path_style and cfg.capacity == 2 << 30
    assert cfg.address == "https://minio.local:9000/corpus/team-a/"
    assert _tier(bucket="abc").endpoint is None and _tier(bucket="abc").prefix == "tiercache/"
    assert (_tier(bucket="abc").policy, _tier(bucket="abc").half_life) == ("prefix", 1.0)  # the default order
    assert (_tier(bucket="abc", policy="lru").policy, _tier(bucket="abc", half_life=3).half_life) == ("lru", 3.0)


@pytest.mark.parametrize(("fields", "where", "says"), [
    ({}, "tiers[0].bucket", "S3 bucket name"),
    ({"bucket": "ab"}, "tiers[0].bucket", "3 to 63"),
    ({"bucket": "Upper"}, "tiers[0].bucket", "lower-case"),
    ({"bucket": "abc", "prefix": "/x/"}, "tiers[0].prefix", "leading '/'"),
    ({"bucket": "abc", "prefix": "x"}, "tiers[0].prefix", "ending in '/'"),
    ({"bucket": "abc", "endpoint": "minio:9000"}, "tiers[0].endpoint", "http:// or https://"),
    ({"bucket": "abc", "concurrency": 0}, "tiers[0].concurrency", "from 1 to 256"),
    ({"bucket": "abc", "sweep_share": 0.9}, "tiers[0].sweep_share", "at most 0.5"),
    ({"bucket": "abc", "policy": "wtinylfu"}, "tiers[0].policy", "allowed: lru, prefix"),
    ({"bucket": "abc", "half_life": 0}, "tiers[0].half_life", "a positive number of turnovers, at most 1000"),
    ({"bucket": "abc", "half_life": 1e4}, "tiers[0].half_life", "at most 1000"),
    ({"bucket": "abc", "half_life": "1"}, "tiers[0].half_life", "a positive number of turnovers"),
])
def test_refusals_name_the_field(fields, where, says):
    with pytest.raises(ConfigError) as exc:
        _tier(**fields)
    assert str(exc.value).startswith(where) and says in str(exc.value)


@pytest.mark.parametrize("key", ["aws_secret_access_key", "secret_key", "access_key", "password"])
def test_credentials_have_no_key_in_the_config(key):
    with pytest.raises(ConfigError, match=f"tiers\\[0\\].{key}: unknown key for a object tier"):
        _tier(bucket="abc", **{key: "s3cr3t"})


def test_an_endpoint_with_a_password_is_refused_without_echoing_it():
    with pytest.raises(ConfigError) as exc:
        _tier(bucket="abc", endpoint="https://user:s3cr3t@minio:9000")
    assert "s3cr3t" not in str(exc.value) and "***" in str(exc.value)
