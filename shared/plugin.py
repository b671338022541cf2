"""vLLM general plugin: makes `TieredKVConnector` and `TieredECConnector` names vLLM's factories know.

vLLM calls every `vllm.general_plugins` entry point in each of its processes (API server, engine core,
workers) before it builds connectors, so users can write `{"kv_connector": "TieredKVConnector"}` without
a module path. Registration only records a module path and a class name (the factories import lazily), is
idempotent (vLLM may load plugins more than once per process), and never imports our connector modules.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

KV_CONNECTOR_NAME = "TieredKVConnector"
EC_CONNECTOR_NAME = "TieredECConnector"
_KV_TARGET = ("kvcache.connector", "TieredKVConnector")
_EC_TARGET = ("eccache.connector", "TieredECConnector")


def _register(factory: type, name: str, module_path: str, class_name: str) -> None:
    if name in getattr(factory, "_registry", {}):
        return
    try:
        factory.register_connector(name, module_path, class_name)
    except ValueError:
        # Another process-level import registered it between our check and our call.
        pass


def register() -> None:
    """Entry point of the `vllm.general_plugins` group: register both connector names, once."""
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
