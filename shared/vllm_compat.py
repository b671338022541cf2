"""Every difference between the vLLM versions this plugin supports, in one place.

Why one module: the connectors lean on vLLM interfaces that are not stable API (the KV connector
`base.py`, `CacheHitSource`, worker-metadata channels, the encoder cache manager). When a release moves
one of them, the change belongs here, next to the range it was verified for, instead of as a `getattr`
scattered through `kvcache/` and `eccache/`. `tests/engine/test_vllm_contract.py` checks the other half of the
contract: the connectors implement every abstract method of the installed base classes with compatible
signatures.

Verified range: `SUPPORTED_RANGE` (see docs/configuration.md, "vLLM compatibility"). Outside it the
connectors still start, but log one warning naming the installed version and the tested range.

What 0.32 -> 0.33 changed for us (read from both releases' sources):

- `KVConnectorBase_V1` gained `supports_sleep_mode`, `unregister_kv_caches`, `restore_kv_caches` (all
  with defaults). The defaults suit us: our workers keep no registration of the KV tensors beyond
  tensor views, and every load and save finishes within the step that planned it.
- The encoder cache manager keeps a per-request `request_hash_refs` table; `vllm_tiercache.eccache.managers` evicts only
  `freeable` entries exactly as vLLM's own `can_allocate` does, so it needs no change.
- With a KV connector configured, 0.33 keeps the legacy block hashes (no EAGLE lookahead hashes).

Rules stated by upstream `base.py` after 0.33 that we follow ahead of time, through this module:
`Request.num_publishable_block_hashes` (only that many leading block hashes may be published by a
content-addressed cache, under EAGLE prefix-cache hashing) and `update_state_after_alloc(...,
num_computed_tokens=None)` (accepted and ignored by our override).
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import re
import sys
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Lowest supported vLLM release (inclusive) and the first one not verified (exclusive).
MIN_VERSION: tuple[int, int] = (0, 32)
MAX_VERSION_EXCLUSIVE: tuple[int, int] = (0, 34)
#: The same range as a requirement specifier (pyproject's `gpu` extra carries this string).
SUPPORTED_RANGE = ">=0.32,<0.34"

try:  # vLLM >= 0.32: the scheduler splits external hits by tier for its metrics.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - only on a vLLM outside the supported range

    class CacheHitSource(enum.Enum):  # type: ignore[no-redef]
        """Stand-in with the members we use, so the scheduler side imports on any vLLM."""

        HOST = "host"
        DISK = "disk"
        EXTERNAL_UNSPECIFIED = "external_unspecified"


try:  # vLLM with failed receives (a whole-request load that failed is recomputed or fails the request)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as TransferResults,
    )
except ImportError:  # pragma: no cover - a vLLM without it calls get_finished only

    @dataclass
    class TransferResults:  # type: ignore[no-redef]
        """Stand-in with vLLM's fields, for a vLLM that never asks for it."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)


def installed_vllm_version() -> str:
    """The installed vLLM's version string ("0.32.0", "0.33.1.dev3+g..."), or "unknown"."""
    try:
        from vllm import __version__
    except ImportError:  # pragma: no cover
        return "unknown"
    return str(__version__)


def parse_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string, or None when it does not start with two numbers."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_supported_version(version: str) -> bool:
    """Whether `version` lies in `SUPPORTED_RANGE` (dev builds of a supported minor count as supported)."""
    parsed = parse_version(version)
    return parsed is not None and MIN_VERSION <= parsed < MAX_VERSION_EXCLUSIVE


@functools.cache
def check_vllm_version(component: str) -> bool:
    """Warn once per component when the installed vLLM is outside the verified range; True when inside.

    A warning, not an error: a newer vLLM often still works, and refusing to start would block users
    from trying. The warning says which version runs and which range was verified, so a failure deep
    in a private hook is traced back to the version at once.
    """
    version = installed_vllm_version()
    if is_supported_version(version):
        return True
    log.warning(
        "%s: vLLM %s is installed; vllm-tiercache is verified with vllm%s. The connector relies on vLLM "
        "hooks that are not stable API; if it fails, install a vLLM in that range or check "
        "docs/configuration.md (vLLM compatibility).",
        component,
        version,
        SUPPORTED_RANGE,
    )
    return False


# ------------------------------------------------------------------------------------------- configs
def explicit_fields(config: Any) -> frozenset[str] | None:
    """Field names the user set on a vLLM config object, or None when this vLLM cannot tell.

    vLLM 0.32 and 0.33 build their configs as pydantic *dataclasses*, which (unlike pydantic models)
    record no `__pydantic_fields_set__`, and the CLI path (`TypeAdapter.validate_json`) does not even
    call `__init__`. So on these versions an explicit value equal to the default is indistinguishable
    from the default; a config class that records its set fields is used as soon as one does.
    """
    names = getattr(config, "__pydantic_fields_set__", None)
    return frozenset(names) if names is not None else None


def field_default(config: Any, name: str) -> Any:
    """The default of dataclass field `name` of `config`'s class (MISSING when it has none)."""
    if not is_dataclass(config):
        return MISSING
    for f in fields(config):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            return MISSING
    return MISSING


def command_line_sets(flag: str, name: str, argv: list[str] | None = None) -> bool:
    """Whether the launch command sets field `name` of the config given by `--<flag>` (JSON or dotted).

    vLLM's server takes `--kv-transfer-config '{"kv_load_failure_policy": "fail", ...}'` (or `=JSON`, or
    `--kv-transfer-config.kv_load_failure_policy fail`), and its engine-core and worker processes keep the
    server's `sys.argv` (fork, or multiprocessing's spawn, which copies it). That is the one record of an
    explicit value equal to the default that vLLM 0.32/0.33 keep; the Python API (`LLM(...)`) leaves none.
    """
    args = sys.argv if argv is None else argv
    spellings = {f"--{flag}", f"--{flag.replace('-', '_')}"}
    for i, arg in enumerate(args):
        head, eq, inline = arg.partition("=")
        if any(head == f"{s}.{name}" for s in spellings):
            return True
        if head not in spellings:
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        try:
            parsed = json.loads(value)
        except ValueError:
            continue
        if isinstance(parsed, dict) and name in parsed:
            return True
    return False


def is_explicitly_set(config: Any, name: str, cli_flag: str | None = None) -> bool:
    """Whether the user set `config.<name>`, as far as the installed vLLM lets us know.

    Known set fields win (`explicit_fields`). Without them, a value different from the field's default
    was necessarily set; a value equal to the default counts as set when the launch command names it
    (`command_line_sets`, for the config given by `--<cli_flag>`), and as not set otherwise: through the
    Python API, the one case we cannot prove.
    """
    known = explicit_fields(config)
    if known is not None:
        return name in known
    default = field_default(config, name)
    if default is MISSING or getattr(config, name) != default:
        return True
    return cli_flag is not None and command_line_sets(cli_flag, name)


def is_encode_only(vllm_config: VllmConfig) -> bool:
    """Whether this instance runs only the multimodal encoder (no language model, no KV cache).

    vLLM 0.32/0.33 make an `ec_role="ec_producer"` instance encoder-only (`ECTransferConfig.is_encode_only`,
    then `mm_encoder_only`); older releases lack the property, so it is derived from the roles.
    """
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is not None:
        encode_only = getattr(ec, "is_encode_only", None)
        if encode_only is None:
            encode_only = bool(getattr(ec, "is_ec_producer", False)) and not bool(getattr(ec, "is_ec_consumer", False))
        if encode_only:
            return True
    return bool(getattr(vllm_config, "is_mm_encoder_only", False))


def has_state_layers(vllm_config: VllmConfig) -> bool:
    """Whether the model has layers with recurrent state (mamba and the like: vLLM's ``is_hybrid`` or
    attention-free models), whose KV cache groups a prefix store cannot load."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return False
    try:
        return bool(getattr(model_config, "is_hybrid", False) or getattr(model_config, "is_attention_free", False))
    except Exception:  # a model vLLM cannot introspect here: no opinion
        return False


def uses_eagle(vllm_config: VllmConfig) -> bool:
    """Whether an EAGLE/MTP drafter with its own KV layers runs (its last accepted position is volatile).

    Under speculative decoding the drafter's KV at the last accepted position may be rewritten when
    draft tokens are rejected, so vLLM's OffloadingConnector (0.33) never stores the trailing chunk of
    a decoding request; we follow the same rule (`KVSchedulerSide(volatile_decode_tail=...)`).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    use_eagle = getattr(spec, "use_eagle", None)
    return bool(use_eagle()) if callable(use_eagle) else False


# ------------------------------------------------------------------------------------------ requests
def publishable_block_count(request: Request) -> int:
    """How many leading block hashes of `request` a content-addressed cache may publish (save under).

    Newer vLLM (after 0.33) sets `request.num_publishable_block_hashes` under EAGLE prefix-cache hashing:
    a block hash past that count is not yet backed by materialized drafter KV, and a chunk saved under it
    could be served to another request with wrong drafter KV. 0.32 and 0.33 have no such field: every
    computed block hash is publishable there.
    """
    count = getattr(request, "num_publishable_block_hashes", None)
    total = len(request.block_hashes)
    return total if count is None else min(int(count), total)


def waiting_for_remote_kv(request: Request) -> bool:
    """Whether `request` waits for a whole-request KV load already handed to the workers (vLLM's
    ``RequestStatus.WAITING_FOR_REMOTE_KVS``, 0.32 and 0.33; False on a vLLM without that status)."""
    from vllm.v1.request import RequestStatus

    status = getattr(RequestStatus, "WAITING_FOR_REMOTE_KVS", None)
    return status is not None and getattr(request, "status", None) == status


# --------------------------------------------------------------------------------------- scheduler
def scheduler_ec_connector(scheduler: Any) -> Any:
    """The EC connector a vLLM scheduler built (None without one); AttributeError on a vLLM whose
    scheduler keeps it elsewhere (0.32 and 0.33: ``Scheduler.ec_connector``)."""
    if not hasattr(scheduler, "ec_connector"):
        raise AttributeError(f"{type(scheduler).__name__} has no attribute 'ec_connector'")
    return scheduler.ec_connector


def prefix_cache_epoch(kv_cache_manager: Any) -> object | None:
    """An object that changes when vLLM resets its prefix cache (its block pool then replaces its hash map and
    publishes `AllBlocksCleared`, after which routers forget every tier of the instance); None when this
    vLLM keeps no such map. Compared by identity only."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    return getattr(pool, "cached_block_hash_to_block", None)
