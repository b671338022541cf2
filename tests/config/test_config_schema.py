"""The config's JSON schema and the docs tables generated from it: complete, true to the validation, and
in docs/configuration.md exactly as the code writes them (regenerate with `make docs`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_tiercache.eccache.options import ECConnectorOptions, ManagerOptions
from vllm_tiercache.kvcache.options import KVConnectorOptions
from vllm_tiercache.shared import config_schema
from vllm_tiercache.shared.config import CONNECTOR_KEYS, TIER_KINDS, ConfigError, StoreConfig
from vllm_tiercache.shared.store import registry
from vllm_tiercache.shared.store.tier_config import section_keys
from vllm_tiercache.tools import config_cmd

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "configuration.md"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("TIERCACHE_CONFIG", "TIERCACHE_NAMESPACE", "TIERCACHE_CHUNK_SIZE", "TIERCACHE_CACHE_DIR",
                 "TIERCACHE_MEMORY_CAPACITY", "TIERCACHE_DISK_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_the_docs_tables_are_the_generated_ones() -> None:
    text = DOCS.read_text()
    found = config_schema.generated_part(text)
    assert found is not None, f"{DOCS.name} lost its {config_schema.BEGIN} / {config_schema.END} lines"
    assert found == config_cmd.docs_markdown(), (
        f"{DOCS.relative_to(REPO)} differs from what the config classes generate; regenerate it with "
        f"{config_schema.REGENERATE}")


def _properties(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every property of the schema and its $defs, as (owner.key, its schema)."""
    out = [(f"<config>.{k}", p) for k, p in schema.get("properties", {}).items()]
    out += [(f"<config>.{k}", p) for k, p in schema.get("patternProperties", {}).items()]
    for name, d in schema.get("$defs", {}).items():
        out += [(f"{name}.{k}", p) for k, p in {**d.get("properties", {}), **d.get("patternProperties", {})}.items()]
    return out


def test_every_key_has_a_description() -> None:
    for schema in (config_cmd.whole_schema(), config_schema.section_schema(ManagerOptions)):
        missing = [name for name, prop in _properties(schema) if not prop.get("description", "").strip()]
        assert not missing, f"keys without a description: {missing}"
        assert all(d.get("description") for d in schema.get("$defs", {}).values())


def test_the_schema_holds_every_key_a_reader_accepts() -> None:
    schema = config_cmd.whole_schema()
    props = schema["properties"]
    store_keys = list(section_keys(StoreConfig))
    assert list(props) == [*store_keys, "config_file", *CONNECTOR_KEYS["TieredKVConnector"],
                           *CONNECTOR_KEYS["TieredECConnector"]]
    assert schema["additionalProperties"] is False and list(schema["patternProperties"]) == ["^x_"]
    # the tiers: a union told apart by kind, one entry per built-in kind, with the keys from_raw accepts
    items = props["tiers"]["items"]
    assert items["discriminator"]["propertyName"] == "kind"
    assert sorted(items["discriminator"]["mapping"]) == sorted(TIER_KINDS)
    assert [ref["$ref"].rsplit("/", 1)[1] for ref in items["oneOf"]] == [
        registry.config_class(kind).__name__ for kind in TIER_KINDS]  # fastest kinds first, as registered
    for kind in TIER_KINDS:
        cls = registry.config_class(kind)
        tier = schema["$defs"][cls.__name__]
        assert tier["properties"]["kind"]["const"] == kind
        assert tuple(sorted(tier["properties"])) == tuple(sorted(section_keys(cls, exclude=("ssl",))))
        assert tier["additionalProperties"] is False
    assert schema["$defs"]["RedisTierConfig"]["required"] == ["url"]
    assert list(schema["$defs"]["RedisTierConfig"]["patternProperties"]) == ["^ssl_"]


def test_the_connector_option_classes_must_match_connector_keys() -> None:
    with pytest.raises(ValueError, match="CONNECTOR_KEYS"):
        config_schema.config_schema({"TieredKVConnector": ECConnectorOptions, "TieredECConnector": KVConnectorOptions})


VALID = {
    "namespace": "prod", "chunk_size": 256, "save_decode": False, "load_failure_policy": "fail",
    "encoder_cache_policy": "lfu", "x_ec_stats_path": "/tmp/ec-{pid}.json", "x_note": 1, "write_queue_size": 64,
    "lookup_budget_ms": 50, "model_version": "v1", "extra": {"x_more": 2},
    "tiers": [{"kind": "memory", "capacity": "1GiB", "policy": "wtinylfu"},
              {"kind": "disk", "path": "/tmp/tiercache-schema", "capacity": 1 << 30, "fsync": True},
              {"kind": "gds", "path": "/tmp/tiercache-schema-gds"},
              {"kind": "redis", "url": "rediss://cache:6380/0", "ttl_s": 60, "part_size": "8MiB",
               "ssl_ca_certs": "/etc/ca.pem"}],
}

BAD = [
    {"namespace": "a|b"}, {"write_queue_size": 0}, {"write_queue_size": True}, {"lookup_budget_ms": 0.5},
    {"chunk_size": 24}, {"save_decode": "yes"}, {"encoder_cache_policy": "no-such-policy"}, {"chunksize": 16},
    {"extra": {"note": 1}}, {"tiers": []}, {"tiers": [{"kind": "ssd"}]},
    {"tiers": [{"kind": "memory", "capacity": 255}]}, {"tiers": [{"kind": "memory", "capacity": "lots"}]},
    {"tiers": [{"kind": "memory", "capasity": "1GiB"}]}, {"tiers": [{"kind": "disk", "policy": "wtinylfu"}]},
    {"tiers": [{"kind": "redis"}]}, {"tiers": [{"kind": "redis", "url": "http://x"}]},
    {"tiers": [{"kind": "redis", "url": "redis://x", "timeout_s": 301}]},
    {"tiers": [{"kind": "redis", "url": "redis://x", "part_size": 100}]},
]


def test_the_schema_and_the_validation_agree() -> None:
    """What the classes accept, the JSON schema accepts; what they refuse for a reason the schema can say
    (type, bound, enum, unknown key, required), the schema refuses too."""
    import jsonschema  # a dev dependency: missing is a failure, never a skip
    validator = jsonschema.Draft202012Validator(config_cmd.whole_schema())
    KVConnectorOptions.load(VALID)
    ECConnectorOptions.load(VALID)
    assert not list(validator.iter_errors(VALID))
    assert not list(validator.iter_errors({}))
    for raw in BAD:
        with pytest.raises(ConfigError):
            KVConnectorOptions.load(raw)
            ECConnectorOptions.load(raw)
        assert list(validator.iter_errors(raw)), raw


def test_the_manager_config_schema_and_the_check_agree() -> None:
    schema = config_schema.section_schema(ManagerOptions)
    assert set(schema["properties"]) == {"policy", "aging_period", "history_size", "size_aware", "window_fraction",
                                         "protected_fraction", "victim_sample"}
    assert schema["properties"]["aging_period"]["default"] == 4096  # the policy class's own default


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_tiercache.tools.cli", "config", "schema", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_the_cli_prints_the_schema_and_rewrites_the_docs(tmp_path: Path) -> None:
    proc = _cli()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == config_cmd.whole_schema()
    proc = _cli("--manager-config")
    assert proc.returncode == 0 and json.loads(proc.stdout)["title"] == "ManagerOptions", proc.stderr[-3000:]
    doc = tmp_path / "configuration.md"
    doc.write_text(f"# Title\n\nbefore\n\n{config_schema.BEGIN}\nstale\n{config_schema.END}\n\nafter\n")
    proc = _cli("--update-docs", str(doc))
    assert proc.returncode == 0 and "updated" in proc.stdout, proc.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "stale" not in text
    assert config_schema.generated_part(text) == config_cmd.docs_markdown()
    assert "up to date" in _cli("--update-docs", str(doc)).stdout
    doc.write_text("no markers\n")
    proc = _cli("--update-docs", str(doc))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("tiercache: error: --update-docs: ") and proc.stderr.count("\n") == 1, proc.stderr
