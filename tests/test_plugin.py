"""The vLLM general plugin registers both connector names lazily and idempotently; the CLI dispatches."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from shared import plugin


def test_entry_point_is_installed_in_vllms_plugin_group() -> None:
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("tiercache") == "shared.plugin:register"


def test_register_is_idempotent_and_lazy() -> None:
    plugin.register()
    plugin.register()  # vLLM may load plugins several times in one process
    assert "TieredKVConnector" in KVConnectorFactory._registry
    assert "TieredECConnector" in ECConnectorFactory._registry
    kv_cls = KVConnectorFactory._registry["TieredKVConnector"]()
    ec_cls = ECConnectorFactory._registry["TieredECConnector"]()
    assert kv_cls.__module__ == "kvcache.connector" and kv_cls.__name__ == "TieredKVConnector"
    assert ec_cls.__module__ == "eccache.connector" and ec_cls.__name__ == "TieredECConnector"


def test_vllm_loads_the_plugin_in_a_fresh_process() -> None:
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins();"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as K;"
        "import sys; print('kvcache.connector' in sys.modules, 'TieredKVConnector' in K._registry)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-2:] == ["False", "True"]  # registered, and nothing imported until used


def test_cli_dispatches_to_the_owning_module() -> None:
    run = [sys.executable, "-m", "shared.cli"]
    top = subprocess.run([*run, "--help"], capture_output=True, text=True, check=True).stdout
    assert "bench" in top and "demo" in top
    sub = subprocess.run([*run, "bench", "tiers", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--redis-url" in sub
    bad = subprocess.run([*run, "bench", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
