"""vLLM general plugin: makes `TieredKVConnector` and `TieredECConnector` names vLLM's factories know.

vLLM calls every `vllm.general_plugins` entry point in each of its processes (API server, engine core,
workers) before it builds connectors, so users can write `{"kv_connector": "TieredKVConnector"}` without
a module path. Registration only records a module path and a class name (the factories import lazily), is
idempotent (vLLM may load plugins more than once per process), and never imports our connector modules.
In the process that builds vLLM's config it also installs the settings check (`vllm_tiercache.preflight`):
a wrong setting of ours then stops the start before any weights load. Where vLLM's scheduler is imported
it makes the scheduler's encoder-cache reset reach the EC connector (`vllm_tiercache.eccache.encoder_reset`).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

KV_CONNECTOR_NAME = "TieredKVConnector"
EC_CONNECTOR_NAME = "TieredECConnector"
_KV_TARGET = ("vllm_tiercache.kvcache.connector", "TieredKVConnector")
_EC_TARGET = ("vllm_tiercache.eccache.connector", "TieredECConnector")


def _register(factory: type, name: str, module_path: str, class_name: str) -> None:
    if name in getattr(factory, "_registry", {}):
        return
    try:
        factory.register_connector(name, module_path, class_name)
    except ValueError:
        # Another process-level import registered it between our check and our call.
        pass


#: Top-level loggers of this project; their records go wherever vLLM's own go (`route_logs_through_vllm`).
_OUR_LOGGERS = ("vllm_tiercache",)


class _ForwardToVllm(logging.Handler):
    """Hands our records to vLLM's `vllm` logger, looked up at emit time (vLLM configures it late)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the root logger has handlers (the user's, or pytest's): the record propagates there
        target = logging.getLogger("vllm")
        if record.levelno >= target.getEffectiveLevel():
            target.handle(record)


def route_logs_through_vllm() -> None:
    """Make an INFO line of ours show in a vLLM server's log, formatted and filtered like vLLM's own.

    vLLM configures only its `vllm` logger (handler, `VLLM_LOGGING_LEVEL`, no propagation), and only after
    plugins may have loaded, so a plain `logging.getLogger(__name__)` of a plugin printed nothing below
    WARNING. A forwarding handler is added once per logger; a logger the user gave handlers or a level is
    left alone.
    """
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    for name in _OUR_LOGGERS:
        ours = logging.getLogger(name)
        if ours.handlers or ours.level != logging.NOTSET:
            continue
        ours.addHandler(_ForwardToVllm())
        ours.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")


def register() -> None:
    """Entry point of the `vllm.general_plugins` group: register both connector names, once."""
    route_logs_through_vllm()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:  # vLLM too old or broken: say so once, never break vLLM's startup
        logger.warning("vllm-tiercache: cannot register %s: %s", KV_CONNECTOR_NAME, exc)
    else:
        _register(KVConnectorFactory, KV_CONNECTOR_NAME, *_KV_TARGET)
    try:
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    except ImportError as exc:
        logger.warning("vllm-tiercache: cannot register %s: %s", EC_CONNECTOR_NAME, exc)
    else:
        _register(ECConnectorFactory, EC_CONNECTOR_NAME, *_EC_TARGET)
    # Where vLLM's scheduler is imported (the engine core): its encoder-cache reset reaches our EC connector
    # (the connector installs it too, when vLLM's scheduler builds it).
    try:
        from vllm_tiercache.eccache.encoder_reset import install as install_encoder_reset

        install_encoder_reset()
    except Exception as exc:  # never break a vLLM start
        logger.warning("vllm-tiercache: encoder-cache resets will not reach TieredECConnector: %s", exc)
    # In the front-end process: check our settings when vLLM builds its config, before weights load.
    try:
        from vllm_tiercache.preflight import install

        install()
    except Exception as exc:  # never break a vLLM start, ours or not: the connectors still check at start
        logger.warning("vllm-tiercache: settings will be checked only when the connectors start: %s", exc)
