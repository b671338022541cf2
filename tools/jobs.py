"""What the producer precompute jobs (`tiercache precompute images|docs`) share.

Why one module: both jobs resolve inputs the same way vLLM will at serving time (vLLM's own input
processor, built offline from the same engine arguments), decide what is already stored before paying
for an engine start, run one producer engine over what is left with a tqdm bar, shut it down cleanly (so
the workers flush their background writes) and then check the store for every record they meant to
write. The summary therefore counts what is really stored, not what was submitted.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.config import ConfigError, StoreConfig, load_file, read_sources
from vllm_tiercache.shared.store import registry
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tiered import TieredStore
from vllm_tiercache.tools.cli import int_at_least

log = logging.getLogger(__name__)

#: Default number of requests handed to one `LLM.generate` call (one progress-bar step).
DEFAULT_BATCH = 16


class JobError(RuntimeError):
    """A precompute job cannot start: the message says what is wrong and how to fix it.

    `vllm_tiercache.tools.cli.main` prints one raised out of any command as one line and exits 2.
    """


@dataclass
class PrecomputeSummary:
    """Outcome of one precompute job; `format()` is what the CLI prints, `to_dict()` its `--json`."""

    kind: str
    total: int = 0
    stored: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    bytes_stored: int = 0
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return self.stored / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["failed"] = [{"name": name, "reason": reason} for name, reason in self.failed]
        out["per_second"] = round(self.per_second, 3)
        out["seconds"] = round(self.seconds, 3)
        return out

    def format(self) -> str:
        unit = self.kind
        lines = [
            f"precompute {self.kind}: {self.total} {unit} in the corpus",
            f"  stored     {self.stored} {unit} ({self.bytes_stored:,} bytes)",
            f"  skipped    {self.skipped} {unit} (already stored)",
            f"  failed     {len(self.failed)} {unit}",
            f"  time       {self.seconds:.1f} s ({self.per_second:.2f} {unit}/s)",
        ]
        for name, value in self.details.items():
            lines.append(f"  {name:<10} {value}")
        for name, reason in self.failed:
            lines.append(f"  FAILED {name}: {reason}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ store config
def admin_config(store_config: Mapping[str, Any] | None) -> StoreConfig:
    """The store config of an admin command (`stats`, `evict`, `pin`, `unpin`): these read no payload, so a
    sealing store's ``encryption`` is left out and the command needs no key ring where it runs."""
    return dataclasses.replace(StoreConfig.load(store_config), encryption=None)


def load_store_arg(value: str) -> dict[str, Any]:
    """`--config` value: a YAML/JSON file path, or inline JSON starting with ``{``."""
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config: inline JSON is invalid ({exc}); pass a JSON object or a file path") from exc
        if not isinstance(data, dict):
            raise ConfigError("--config: inline JSON must be an object of store options")
        return data
    return load_file(text, origin="--config")


def checked_store_config(store_config: Mapping[str, Any] | None) -> StoreConfig:
    """Validate a producer job's store config: it must have a tier that outlives the job's processes.

    Whether a tier does is its class's `shared_across_processes` (the tier contract), so a new tier kind
    needs no line here; the class is imported, not built (no directory is made, no server is dialled).
    """
    config = StoreConfig.load(dict(store_config) if store_config else None)
    if not any(registry.tier_class(t.kind).shared_across_processes for t in config.tiers):
        raise ConfigError(
            "tiers: a precompute job needs a disk, gds or redis tier; a memory tier alone dies with the job. "
            "Add e.g. {\"kind\": \"disk\", \"path\": \"/var/cache/tiercache\"} to the store config"
        )
    return config


def write_through(store_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The store config a producer engine runs with: every tier's ``admission`` set to ``always``.

    Why: a precompute job stores a corpus for later requests; a tier configured to admit only what is used
    again (`vllm_tiercache.shared.store.admission`) would keep it in the producer's memory, which dies with
    the job. The config's sources are read first (``config_file``, $TIERCACHE_CONFIG), so a tier declared
    there is covered too; a config without any ``admission`` comes back as it was.
    """
    raw = read_sources(dict(store_config) if store_config else None)
    tiers = raw.get("tiers")
    if not isinstance(tiers, list) or not any(isinstance(t, Mapping) and "admission" in t for t in tiers):
        return dict(store_config or {})
    raw["tiers"] = [{**t, "admission": {"policy": "always"}} if isinstance(t, Mapping) and "admission" in t else t
                    for t in tiers]
    return raw


def record_sizes(store: TieredStore, keys: Sequence[StoreKey]) -> list[int | None]:
    """Stored size of each record, from the first shared tier that knows it (index/heads; no payload read).

    Only shared tiers: the job's own memory tier holds what this process wrote, not what the engine's
    workers stored.
    """
    sizes: list[int | None] = [None] * len(keys)
    for tier in store.tiers:
        missing = [i for i, s in enumerate(sizes) if s is None]
        if not tier.shared_across_processes or not missing:
            continue
        for i, size in zip(missing, tier.sizes_many([keys[i] for i in missing]), strict=True):
            sizes[i] = size
    return sizes


# ---------------------------------------------------------------------------------------------- engines
def engine_config(model: str, engine_kwargs: Mapping[str, Any], **transfer: Any) -> Any:
    """The `VllmConfig` an `LLM(model, **engine_kwargs, **transfer)` would build, without starting it.

    Block size, hash algorithm, dtype and the multimodal settings come out exactly as in the engine
    (the platform adjusts them in `VllmConfig.__post_init__`), so cache keys computed from it match.
    """
    from vllm.engine.arg_utils import EngineArgs

    try:
        return EngineArgs(model=model, **dict(engine_kwargs), **transfer).create_engine_config()
    except TypeError as exc:
        raise JobError(f"invalid engine argument: {exc}; see `vllm serve --help` for EngineArgs names") from exc


def offline_input_processor(vllm_config: Any) -> Any:
    """vLLM's own `InputProcessor` (tokenizer, multimodal processor and hasher), with no engine behind it."""
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    return InputProcessor(vllm_config, renderer_from_config(vllm_config))


def process_offline(processor: Any, prompt: Any) -> Any:
    """The `EngineCoreRequest` vLLM would schedule for ``prompt``: token ids and `mm_features`."""
    from vllm import SamplingParams

    return processor.process_inputs("tiercache-precompute", prompt, SamplingParams(max_tokens=1),
                                    supported_tasks=("generate",))


#: Engine arguments that give an engine more than one worker; such an engine keeps vLLM's process layout.
_PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def start_llm(model: str, engine_kwargs: Mapping[str, Any], **transfer: Any) -> Any:
    """Start the job's engine; with one worker, in this very process.

    A job has no API server to keep responsive, so vLLM's engine-core process and worker process buy it
    nothing: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (and the uniproc executor vLLM then picks) the job
    imports vLLM once instead of three times and its engine is ready several times sooner. The connectors
    behave the same: their scheduler and worker sides still talk only through vLLM's connector metadata.
    An engine with several workers, or an operator's own ``VLLM_ENABLE_V1_MULTIPROCESSING``, keeps vLLM's
    choice.
    """
    from vllm import LLM

    if "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and all(
            int(engine_kwargs.get(name) or 1) <= 1 for name in _PARALLEL_ARGS):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return LLM(model=model, **dict(engine_kwargs), **transfer)


def shutdown_llm(llm: Any) -> None:
    """Stop the engine now, so its workers run the connectors' shutdown (which flushes queued writes).

    Without this, records still in a worker's background queue could be lost when the job exits.
    """
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort: the store check after it tells what really got stored
        log.warning("tiercache precompute: engine shutdown failed: %s", exc)
    del llm
    gc.collect()


def wait_for_records(store: TieredStore, keys: Sequence[StoreKey], *, idle_timeout_s: float = 15.0
                     ) -> set[StoreKey]:
    """Wait until the engine's workers have written ``keys`` to a shared tier, before stopping the engine.

    Why: workers save from background threads and vLLM's shutdown may kill them without a drain. We
    poll the store (batched lookups) and stop waiting once nothing new arrived for ``idle_timeout_s``;
    the check after shutdown reports whatever is still missing. Returns the keys seen stored: a record
    that `tiercache evict` (or another process's LRU eviction) removes after it was written was stored
    all the same, and the job must not report it as a failed write.
    """
    import time

    seen: set[StoreKey] = set()
    missing = list(keys)
    last_progress = time.monotonic()
    while missing:
        present = store.contains_many(missing, shared_only=True, bounded=False)
        seen.update(k for k, hit in zip(missing, present, strict=True) if hit)
        still = [k for k, hit in zip(missing, present, strict=True) if not hit]
        if len(still) < len(missing):
            last_progress = time.monotonic()
        missing = still
        if not missing or time.monotonic() - last_progress > idle_timeout_s:
            return seen
        time.sleep(0.2)
    return seen


def batches(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for lo in range(0, len(items), size):
        yield items[lo:lo + size]


# ------------------------------------------------------------------------------------------------- CLI
def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every precompute job takes. Engine options must match the serving engine's."""
    parser.add_argument("--model", required=True, help="model name or path (as given to the serving engine)")
    parser.add_argument("--config", required=True, metavar="STORE",
                        help="store config: a YAML/JSON file or inline JSON (same as the connector's extra config)")
    parser.add_argument("--max-model-len", type=int_at_least(1), default=None, help="engine max_model_len")
    parser.add_argument("--block-size", type=int_at_least(1), default=None,
                        help="engine block_size (must match serving)")
    parser.add_argument("--dtype", default=None, help="engine dtype (must match serving)")
    parser.add_argument("--enforce-eager", action="store_true", help="engine enforce_eager")
    parser.add_argument("--engine-args", default=None, metavar="JSON",
                        help='more vLLM engine arguments as a JSON object, e.g. \'{"gpu_memory_utilization": 0.5}\'')
    parser.add_argument("--batch-size", type=int_at_least(1), default=DEFAULT_BATCH,
                        help="requests per engine call, 1 or more (default 16)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def engine_args_json(text: str | None) -> dict[str, Any]:
    """The ``--engine-args`` JSON object (empty when not given); a `JobError` saying how to write it."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobError(f"--engine-args: invalid JSON ({exc}); pass an object like '{{\"seed\": 0}}'") from exc
    if not isinstance(extra, dict):
        raise JobError("--engine-args: pass a JSON object of engine arguments")
    return extra


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = engine_args_json(args.engine_args)
    for name in ("max_model_len", "block_size", "dtype"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.batch_size <= 0:
        raise JobError(f"--batch-size must be positive, got {args.batch_size}")
    return kwargs


def report(summary: PrecomputeSummary, as_json: bool) -> int:
    """Print the summary; exit status 1 when something failed (so scripts notice), else 0."""
    print(json.dumps(summary.to_dict(), indent=2) if as_json else summary.format())
    return 1 if summary.failed else 0


def fail(message: str) -> int:
    print(f"tiercache: error: {message}", file=sys.stderr)
    return 2


def gather_files(source: Path, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """Files of ``source``: a directory (its files with ``suffixes``, sorted) or a text file listing paths.

    In a list file, blank lines and lines starting with ``#`` are ignored and relative paths are taken
    relative to the list file. Listed paths are returned even when missing (the job reports them).
    """
    if source.is_dir():
        return sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
    if source.is_file():
        out = []
        for line in source.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                path = Path(line).expanduser()
                out.append(path if path.is_absolute() else source.parent / path)
        return out
    raise JobError(f"{what}: {str(source)!r} is neither a directory nor a list file")
