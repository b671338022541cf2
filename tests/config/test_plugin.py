"""The vLLM general plugin registers both connector names lazily and idempotently; the CLI dispatches."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from vllm_tiercache import plugin


def test_entry_point_is_installed_in_vllms_plugin_group() -> None:
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("tiercache") == "vllm_tiercache.plugin:register"


def test_register_is_idempotent_and_lazy() -> None:
    plugin.register()
    plugin.register()  # vLLM may load plugins several times in one process
    assert "TieredKVConnector" in KVConnectorFactory._registry
    assert "TieredECConnector" in ECConnectorFactory._registry
    kv_cls = KVConnectorFactory._registry["TieredKVConnector"]()
    ec_cls = ECConnectorFactory._registry["TieredECConnector"]()
    assert kv_cls.__module__ == "vllm_tiercache.kvcache.connector" and kv_cls.__name__ == "TieredKVConnector"
    assert ec_cls.__module__ == "vllm_tiercache.eccache.connector" and ec_cls.__name__ == "TieredECConnector"


#: One fresh interpreter for the tests below (each asserts on its own part of the output): vLLM's scheduler
#: imported and its plugins loaded, as in its engine core; then vLLM configures its logging, and two lines
#: of ours are logged.
_FRESH_PROCESS = (  # plugins load first, vLLM configures its logging after (the engine processes' order)
    "import logging, sys\n"
    "import vllm.v1.core.sched.scheduler as s\n"
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as K\n"
    "print('registered:', 'vllm_tiercache.kvcache.connector' in sys.modules, 'TieredKVConnector' in K._registry,"
    " flush=True)\n"
    "print('reset wrapped:', getattr(s.Scheduler.reset_encoder_cache, '_vllm_tiercache_encoder_reset', False),"
    " flush=True)\n"
    "from vllm.config import LoggingConfig\n"
    "from vllm.logger import configure_logging\n"
    "configure_logging(LoggingConfig())\n"
    "logging.getLogger('vllm_tiercache.kvcache.connector').info('tiercache-visible-line')\n"
    "logging.getLogger('vllm_tiercache.kvcache.connector').debug('tiercache-debug-line')\n"
)


@pytest.fixture(scope="module")
def fresh_process() -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_vllm_loads_the_plugin_in_a_fresh_process(fresh_process: subprocess.CompletedProcess[str]) -> None:
    (line,) = [line for line in fresh_process.stdout.splitlines() if line.startswith("registered:")]
    assert line.split()[1:] == ["False", "True"]  # registered, and nothing imported until used


def test_the_plugin_installs_the_encoder_reset_wrapper_where_vllms_scheduler_runs(
        fresh_process: subprocess.CompletedProcess[str]) -> None:
    """`vllm_tiercache.eccache.encoder_reset`: vLLM's encoder-cache reset reaches the EC connector."""
    (line,) = [line for line in fresh_process.stdout.splitlines() if line.startswith("reset wrapped:")]
    assert line.split()[-1] == "True"


def test_cli_dispatches_to_the_owning_module() -> None:
    run = [sys.executable, "-m", "vllm_tiercache.tools.cli"]
    top = subprocess.run([*run, "--help"], capture_output=True, text=True, check=True).stdout
    assert "bench" in top and "demo" in top
    sub = subprocess.run([*run, "bench", "tiers", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--redis-url" in sub
    bad = subprocess.run([*run, "bench", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_our_info_lines_reach_vllms_log_handlers_in_a_fresh_process(
        fresh_process: subprocess.CompletedProcess[str]) -> None:
    """vLLM configures only its own logger; after the plugin loads, an INFO line of ours prints like vLLM's."""
    proc = fresh_process
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "tiercache-visible-line" in line]
    assert lines and "INFO" in lines[0], proc.stdout + proc.stderr[-2000:]
    assert "tiercache-debug-line" not in proc.stdout + proc.stderr  # vLLM's level (INFO) filters ours too


def test_loggers_the_user_configured_are_left_alone() -> None:
    import logging

    ours = logging.getLogger("vllm_tiercache")
    mine = logging.NullHandler()
    saved = list(ours.handlers)
    saved_level = ours.level
    ours.handlers = [mine]
    try:
        plugin.route_logs_through_vllm()
        assert ours.handlers == [mine] and ours.level == saved_level
    finally:
        ours.handlers = saved
