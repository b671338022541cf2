"""StoreConfig: defaults, sources (dict, config_file, TIERCACHE_CONFIG), normalization and error messages."""

from __future__ import annotations

import json

import pytest

from vllm_tiercache.shared.config import (
    ConfigError,
    DiskTierConfig,
    MemoryTierConfig,
    RedisTierConfig,
    StoreConfig,
    parse_size,
)

EXAMPLE = {
    "namespace": "prod",
    "chunk_size": 256,
    "tiers": [
        {"kind": "memory", "capacity": "8GiB"},
        {"kind": "disk", "path": "/var/cache/tiercache", "capacity": "500GiB"},
        {"kind": "redis", "url": "redis://cache:6379/0"},
    ],
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for name in ("TIERCACHE_CONFIG", "TIERCACHE_NAMESPACE", "TIERCACHE_CHUNK_SIZE", "TIERCACHE_CACHE_DIR",
                 "TIERCACHE_MEMORY_CAPACITY", "TIERCACHE_DISK_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_defaults_memory_then_disk_in_user_cache_dir(tmp_path):
    cfg = StoreConfig.load(None)
    assert cfg.namespace == "default" and cfg.chunk_size == 256
    assert cfg.save_partial_chunks is True and cfg.save_decode is False and cfg.write_queue_size == 256
    assert cfg.encoder_cache_policy is None and cfg.extra == {}
    mem, disk = cfg.tiers
    assert isinstance(mem, MemoryTierConfig) and mem.capacity == 2 << 30
    assert isinstance(disk, DiskTierConfig) and disk.fsync is True
    assert disk.path == str(tmp_path / "xdg" / "vllm-tiercache")
    assert StoreConfig.load({}) == cfg


def test_example_config():
    cfg = StoreConfig.load(EXAMPLE)
    assert cfg.namespace == "prod"
    assert [t.kind for t in cfg.tiers] == ["memory", "disk", "redis"]
    assert cfg.tiers[0].capacity == 8 << 30
    assert cfg.tiers[1].capacity == 500 << 30 and cfg.tiers[1].path == "/var/cache/tiercache"
    redis_cfg = cfg.tiers[2]
    assert isinstance(redis_cfg, RedisTierConfig)
    assert redis_cfg.part_size == 8 << 20 and redis_cfg.ttl_s is None and not redis_cfg.cluster
    json.dumps(cfg.to_dict())


@pytest.mark.parametrize(("text", "value"), [
    ("8GiB", 8 << 30), ("500MB", 500_000_000), ("1.5GiB", 3 << 29), ("64KiB", 65536), ("1024", 1024),
    (4096, 4096), ("2 mib", 2 << 20),
])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize(("raw", "field", "allowed"), [
    ({"tiers": [{"kind": "ssd"}]}, "tiers[0].kind", "allowed: memory, disk, gds, redis"),
    ({"tiers": [{"kind": "memory"}, {"kind": "disk", "capacity": "lots"}]}, "tiers[1].capacity", "8GiB"),
    ({"tiers": [{"kind": "memory", "policy": "arc"}]}, "tiers[0].policy", "allowed: lru, wtinylfu"),
    ({"tiers": [{"kind": "disk", "policy": "wtinylfu"}]}, "tiers[0].policy", "allowed: lru"),
    ({"encoder_cache_policy": "fifo"}, "encoder_cache_policy", "allowed: lru, lfu, wtinylfu or null"),
    ({"tiers": [{"kind": "redis", "url": "http://x"}]}, "tiers[0].url", "rediss+cluster://"),
    ({"tiers": [{"kind": "redis", "url": "redis://x", "ttl_s": -1}]}, "tiers[0].ttl_s", "positive"),
    ({"tiers": [{"kind": "disk", "fsync": "yes"}]}, "tiers[0].fsync", "true or false"),
    ({"chunk_size": 100}, "chunk_size", "multiple of 16"),
    ({"chunk_size": 0}, "chunk_size", "multiple of 16"),
    ({"write_queue_size": 0}, "write_queue_size", "positive int"),
    ({"save_decode": 1}, "save_decode", "true or false"),
    ({"namespace": ""}, "namespace", "non-empty"),
    ({"tiers": []}, "tiers", "non-empty list"),
])
def test_errors_name_field_value_and_allowed(raw, field, allowed):
    with pytest.raises(ConfigError) as info:
        StoreConfig.load(raw)
    msg = str(info.value)
    assert msg.startswith(field), msg
    assert allowed in msg, msg
    assert isinstance(info.value, ValueError)


def test_bad_value_is_in_message():
    with pytest.raises(ConfigError, match="'ssd'"):
        StoreConfig.load({"tiers": [{"kind": "ssd"}]})


def test_unknown_keys_listed():
    with pytest.raises(ConfigError, match=r"chunksize: unknown key; known keys: namespace, chunk_size"):
        StoreConfig.load({"chunksize": 16})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.size: unknown key.*known keys: kind, capacity"):
        StoreConfig.load({"tiers": [{"kind": "memory", "size": 1}]})


def test_x_prefixed_keys_kept_in_extra():
    cfg = StoreConfig.load({"x_note": "hi", "extra": {"x_more": 1}, "tiers": [{"kind": "memory"}]})
    assert cfg.extra == {"x_note": "hi", "x_more": 1}


def test_redis_fields_and_ssl_passthrough():
    cfg = StoreConfig.load({"tiers": [{"kind": "redis", "url": "rediss+cluster://h:1", "password": "p",
                                       "ttl_s": 60, "part_size": "1MiB", "timeout_s": 0.5,
                                       "retry_after_s": 1, "ssl_ca_certs": "/ca.pem",
                                       "ssl_cert_reqs": "required"}]})
    t = cfg.tiers[0]
    assert t.cluster and t.password == "p" and t.ttl_s == 60 and t.part_size == 1 << 20
    assert dict(t.ssl) == {"ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": "required"}
    with pytest.raises(ConfigError, match="ssl_ca_certs"):
        StoreConfig.load({"tiers": [{"kind": "redis", "url": "redis://h", "ssl_ca_certs": "/x"}]})
    assert RedisTierConfig(url="redis://:secret@h:1/0").address == "redis://h:1/0"


def test_config_file_yaml_and_json_and_env(tmp_path, monkeypatch):
    yml = tmp_path / "c.yaml"
    yml.write_text("namespace: fromfile\nchunk_size: 32\ntiers:\n  - kind: memory\n    capacity: 1MiB\n")
    cfg = StoreConfig.load({"config_file": str(yml), "chunk_size": 64})
    assert cfg.namespace == "fromfile" and cfg.chunk_size == 64  # extra keys override the file
    js = tmp_path / "c.json"
    js.write_text(json.dumps(EXAMPLE))
    monkeypatch.setenv("TIERCACHE_CONFIG", str(js))
    assert StoreConfig.load(None).namespace == "prod"
    assert StoreConfig.load({"tiers": [{"kind": "memory"}]}).namespace == "default"  # extra wins
    monkeypatch.setenv("TIERCACHE_NAMESPACE", "envns")
    monkeypatch.setenv("TIERCACHE_CHUNK_SIZE", "512")
    cfg = StoreConfig.load(None)
    assert cfg.namespace == "envns" and cfg.chunk_size == 512
    with pytest.raises(ConfigError, match="config_file: cannot read"):
        StoreConfig.load({"config_file": str(tmp_path / "missing.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [kind: memory\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        StoreConfig.load({"config_file": str(bad)})


def test_env_default_capacities(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path / "cd"))
    monkeypatch.setenv("TIERCACHE_MEMORY_CAPACITY", "1GiB")
    monkeypatch.setenv("TIERCACHE_DISK_CAPACITY", "3GiB")
    mem, disk = StoreConfig.load(None).tiers
    assert mem.capacity == 1 << 30 and disk.capacity == 3 << 30 and disk.path == str(tmp_path / "cd")


def test_cache_key_is_normalized():
    a = StoreConfig.load({"tiers": [{"kind": "memory", "capacity": "1GiB"}], "namespace": "a"})
    b = StoreConfig.load({"tiers": [{"kind": "memory", "capacity": 1 << 30}], "namespace": "b"})
    assert a.cache_key() == b.cache_key()


def test_duplicate_disk_path_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path"):
        StoreConfig.load({"tiers": [{"kind": "disk", "path": str(tmp_path)},
                                    {"kind": "gds", "path": str(tmp_path)}]})


def test_eviction_policies_selected_per_tier_and_for_the_encoder_cache():
    cfg = StoreConfig.load({"encoder_cache_policy": "wtinylfu",
                            "tiers": [{"kind": "memory", "policy": "wtinylfu"}, {"kind": "disk", "policy": "lru"}]})
    assert cfg.encoder_cache_policy == "wtinylfu"
    assert [t.policy for t in cfg.tiers] == ["wtinylfu", "lru"]
    assert StoreConfig.load({"tiers": [{"kind": "memory"}]}).tiers[0].policy == "lru"
