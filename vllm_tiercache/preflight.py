"""Check this plugin's settings when vLLM builds the engine's config: a mistake stops the start in seconds.

Why here and not only in the connectors: vLLM builds the scheduler-side KV connector after the weights
are loaded and the KV cache is sized, so a wrong tier kind or option used to surface after 15 s with a
tiny model (minutes with a real one), inside a worker traceback. vLLM 0.32 offers no hook that hands a
plugin the config; it does build the whole `VllmConfig` in one method of the front-end process,
`EngineArgs.create_engine_config` (the OpenAI server and `LLM(...)` both go through it), and it loads
general plugins before that call. `install` wraps that method once per process: the config vLLM built is
returned unchanged after `check_engine_config` found nothing wrong. A vLLM without the method is left
alone (the connectors still check the same rules when they start: `check_kv_config`, `check_ec_config`,
`PolicyEncoderCacheManager.check_config` are the functions both places call).

What is checked, for the parts that name this plugin: the KV connector (also as a MultiConnector
child), the EC connector, an encoder cache manager of ours (`--ec-manager-config`), and that every
directory a tier would own can be created and written, and that a tier declaring `ChecksAtPreflight`
finds its backend takes its settings (the object tier: one HEAD of its bucket, with its credentials).
Nothing else is opened: no store, no Redis connection, no weight file read; a sealing store's key ring
is read (and refused in one line when it cannot be: `check_encryption`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_tiercache.shared.store.tier_config import ConfigError, did_you_mean

logger = logging.getLogger(__name__)

KV_CONNECTOR_NAME = "TieredKVConnector"
EC_CONNECTOR_NAME = "TieredECConnector"
_OUR_PACKAGE = "vllm_tiercache."
_MANAGERS_MODULE = "vllm_tiercache.eccache.managers"
_MARK = "_vllm_tiercache_preflight"


def install() -> bool:
    """Make `EngineArgs.create_engine_config` run `check_engine_config` on what it builds (once per process).

    Only where vLLM's engine arguments are already imported: the front-end process, which is where
    vLLM loads plugins before building the config. The engine core and worker processes receive a built
    config and are left as they are. Returns whether the check is in place.
    """
    from vllm_tiercache.shared.patching import call_after

    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    engine_args = getattr(arg_utils, "EngineArgs", None)
    return call_after(engine_args, "create_engine_config",
                      lambda _args, vllm_config: check_engine_config(vllm_config), _MARK)


def check_engine_config(vllm_config: Any) -> None:
    """Raise `ConfigError` naming the vLLM setting, the field, the bad value and the fix, for the first
    mistake in a part of ``vllm_config`` that names this plugin; return quietly otherwise."""
    started = time.monotonic()
    checked, stores = [], []
    for where, transfer in _our_kv_transfers(vllm_config):
        from vllm_tiercache.kvcache.connector import check_kv_config

        with _named(where):
            store = check_kv_config(vllm_config, transfer, final_block_size=False).store
            check_tier_directories(store)
            check_encryption(store)
            check_tier_backends(store)
        if transfer.is_kv_producer:  # the connector's own rule for saving (a consumer never writes)
            stores.append(store)
        checked.append(KV_CONNECTOR_NAME)
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is not None and getattr(ec, "ec_connector", None) == EC_CONNECTOR_NAME:
        from vllm_tiercache.eccache.connector import check_ec_config

        with _named("ec_transfer_config (--ec-transfer-config)"):
            store = check_ec_config(vllm_config)[1]
            check_tier_directories(store)
            check_encryption(store)
            check_tier_backends(store)
        if ec.is_ec_producer:
            stores.append(store)
        checked.append(EC_CONNECTOR_NAME)
    warn_if_shutdown_drops_writes(vllm_config, stores)
    manager = getattr(getattr(vllm_config, "ec_manager_config", None), "encoder_cache_manager_cls", None)
    if isinstance(manager, str) and manager.startswith(_OUR_PACKAGE):
        with _named("ec_manager_config (--ec-manager-config)"):
            _check_manager(manager, vllm_config)
        checked.append(manager.rsplit(".", 1)[-1])
    if checked:
        logger.info("vllm-tiercache: %s settings checked before the model loads (%.0f ms)", ", ".join(checked),
                    (time.monotonic() - started) * 1e3)


def warn_if_shutdown_drops_writes(vllm_config: Any, stores: list[Any]) -> None:
    """Warn when vLLM would kill the engine process the moment it stops while a store of ours (``stores``:
    those of connectors whose role writes) writes to a slower tier behind the requests.

    Why: with ``shutdown_timeout`` 0 (vLLM's default) an OpenAI server SIGKILLs the engine core right after
    asking it to stop (an offline `LLM` gives it a fixed 5 s), so the connectors' shutdown may never run:
    records still queued for disk or Redis, and the event journal's last entries, are lost. That costs
    misses after the restart (never wrong data), which an operator would otherwise only see as a cold
    restart."""
    if getattr(vllm_config, "shutdown_timeout", None) != 0:
        return
    from vllm_tiercache.shared.store.api import InProcessTier
    from vllm_tiercache.shared.store.registry import tier_class

    slower = sorted({tier.kind for store in stores for tier in store.tiers
                     if not issubclass(tier_class(tier.kind), InProcessTier)})
    if not slower:
        return
    logger.warning("vllm-tiercache: with --shutdown-timeout 0 (vLLM's default) a stopping OpenAI server kills "
                   "its engine process at once (an offline LLM(...) allows it 5 s), so writes still queued for "
                   "the %s tier(s) at that moment are lost (misses after a restart, never wrong data); pass "
                   "--shutdown-timeout 15 to the server to give the connectors time to finish them",
                   ", ".join(slower))


def _our_kv_transfers(vllm_config: Any) -> Iterator[tuple[str, Any]]:
    """(where the user set it, the `KVTransferConfig`) of each of our KV connectors: the engine's own, or
    MultiConnector children (built the way MultiConnector builds them)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        return
    where = "kv_transfer_config (--kv-transfer-config)"
    if kv.kv_connector == KV_CONNECTOR_NAME:
        yield where, kv
    elif kv.kv_connector == "MultiConnector":
        from vllm.config import KVTransferConfig

        children = (kv.kv_connector_extra_config or {}).get("connectors") or []
        for i, child in enumerate(children):
            if isinstance(child, dict) and child.get("kv_connector") == KV_CONNECTOR_NAME:
                fields = {**child, "engine_id": child.get("engine_id", kv.engine_id)}
                yield f"{where} connectors[{i}]", KVTransferConfig(**fields)


@contextmanager
def _named(where: str) -> Iterator[None]:
    """A `ConfigError` (or the refusal of a hash seed that differs per process) raised inside is raised
    again as a `ConfigError` with the vLLM setting it came from in front."""
    from vllm_tiercache.shared.naming.hashing import UnstableHashSeedError

    try:
        yield
    except (ConfigError, UnstableHashSeedError) as exc:
        raise ConfigError(f"vllm-tiercache: {where}: {exc}") from None


def check_tier_directories(store: Any) -> None:
    """Every directory a tier of ``store`` owns (disk, gds) is a writable directory, or its nearest existing
    ancestor is one this user can create it in: what the tier would otherwise find out when it opens,
    after the weights loaded. Nothing is created here (building a config has no side effects), and a
    path with no existing ancestor at all (a mount not there yet) is left to the tier."""
    for i, tier_config in enumerate(store.tiers):
        path = getattr(tier_config, "path", None)
        if not isinstance(path, str) or not path:
            continue
        reason = _unusable_directory(path)
        if reason is not None:
            raise ConfigError(f"tiers[{i}].path: cannot use {path!r} as the {tier_config.kind} tier's directory "
                              f"({reason}); allowed: a local directory this user can create and write")


def check_tier_backends(store: Any) -> None:
    """Ask each tier that declares `ChecksAtPreflight` (object: one HEAD of its bucket) whether its backend
    takes its settings: a missing bucket or refused credentials is a `ConfigError` naming the setting; an
    endpoint that does not answer is a warning (the tier starts down, requests are served without it)."""
    from vllm_tiercache.shared.store.api import ChecksAtPreflight
    from vllm_tiercache.shared.store.registry import tier_class

    for i, tier_config in enumerate(store.tiers):
        cls = tier_class(tier_config.kind)
        if issubclass(cls, ChecksAtPreflight):
            cls.preflight(tier_config, f"tiers[{i}]")


def check_encryption(store: Any) -> None:
    """A sealing store's key ring (``encryption.ring``) can be read and is a valid ring: else one
    `ConfigError` line naming the setting and the fix, never a key (`load_ring`). Only the ring is read."""
    encryption = getattr(store, "encryption", None)
    if encryption is not None:
        from vllm_tiercache.shared.store.sealing.ring import load_ring

        load_ring(encryption.ring)


def _unusable_directory(path: str) -> str | None:
    """Why the tier could not create or write ``path``, or None when it can (or this cannot be told)."""
    from vllm_tiercache.shared.store.tiers.disk.config import nearest_existing_ancestor

    probe = nearest_existing_ancestor(path)
    if probe is None:
        return None
    if not os.path.isdir(probe):
        return f"{probe!r} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe!r} is not writable by user id {os.getuid()}"
    return None


def _check_manager(class_path: str, vllm_config: Any) -> None:
    """Our encoder cache manager class exists and takes every `manager_config` option given."""
    from vllm_tiercache.eccache import managers

    module, _, name = class_path.rpartition(".")
    ours = sorted(n for n, v in vars(managers).items()
                  if isinstance(v, type) and issubclass(v, managers.PolicyEncoderCacheManager))
    cls = getattr(managers, name, None) if module == _MANAGERS_MODULE else None
    if not (isinstance(cls, type) and issubclass(cls, managers.PolicyEncoderCacheManager)):
        raise ConfigError(f"encoder_cache_manager_cls: invalid value {class_path!r}; "
                          f"{did_you_mean(name, ours)}allowed: "
                          + ", ".join(f"{_MANAGERS_MODULE}.{n}" for n in ours))
    cls.check_config(vllm_config)
