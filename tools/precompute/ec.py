"""`tiercache precompute images`: fill the encoder cache for an image corpus before serving it.

Runs vLLM as an `ec_producer` (vLLM 0.32 then runs the multimodal encoder only, no language model)
over every image that the store does not hold yet. An image is named by vLLM's own mm_hash, computed by
vLLM's own input processor offline, so a rerun skips what is stored and resumes where a killed job
stopped. Images are loaded the way vLLM's OpenAI server loads an uploaded image (`ImageMediaIO`: the
hash covers the file's bytes), so a request that sends the same file hits; use `load_image` when you
pass images through the Python API, or the hashes will differ (vLLM hashes a bare PIL image by pixels).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_tiercache.eccache.options import ECConnectorOptions
from vllm_tiercache.shared.config import ConfigError
from vllm_tiercache.shared.naming.keys import EncoderIdentity, encoder_key, weights_of
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.tools.jobs import (
    DEFAULT_BATCH,
    JobError,
    PrecomputeSummary,
    add_engine_arguments,
    checked_store_config,
    engine_config,
    engine_kwargs_from_args,
    fail,
    gather_files,
    load_store_arg,
    offline_input_processor,
    process_offline,
    report,
    write_through,
)
from vllm_tiercache.tools.precompute.passes import count_stored, produce, retag
from vllm_tiercache.tools.precompute.tagging import add_job_tag_arguments, check_pin_tags, item_tags, pin_after_job
from vllm_tiercache.tools.precompute.waits import DEFAULT_STORE_PATIENCE_S, add_patience_argument, patient_config

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def load_image(path: str | Path) -> Any:
    """An image as vLLM's server loads it: RGB, wrapped with its file bytes (which its mm_hash covers).

    Raises ValueError naming the file when it is unreadable or not an image.
    """
    from vllm.multimodal.media.image import ImageMediaIO

    p = Path(path)
    try:
        return ImageMediaIO().load_file(p)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{p.name}: not a readable image ({exc})") from exc


def image_prompt(vllm_config: Any) -> str:
    """The text of a one-image request: vLLM's own dummy text for one image (its placeholder, if any)."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    processor = MULTIMODAL_REGISTRY.create_processor(vllm_config.model_config)
    return processor.dummy_inputs.get_dummy_text({"image": 1})


def ec_transfer(store_config: Mapping[str, Any], role: str = "ec_producer") -> dict[str, Any]:
    from vllm.config import ECTransferConfig

    return {"ec_transfer_config": ECTransferConfig(
        ec_connector="TieredECConnector", ec_connector_module_path="vllm_tiercache.eccache.connector", ec_role=role,
        ec_connector_extra_config=write_through(store_config),
    )}


def precompute_images(
    model: str,
    images: list[Path],
    store_config: dict[str, Any],
    *,
    progress: bool = True,
    engine_kwargs: dict[str, Any] | None = None,
    batch_size: int = DEFAULT_BATCH,
    tags: Sequence[str] = (),
    pin: bool = False,
    store_patience_s: float = DEFAULT_STORE_PATIENCE_S,
) -> PrecomputeSummary:
    """Encode every image not yet stored and store its encoder output; returns what happened.

    The store is patient (``store_patience_s``, `vllm_tiercache.tools.precompute.waits`): a tier that is
    slow, down or throttling is waited out, and an image fails only once it wrote nothing for that long.

    Each image's record carries the tags ``image:<name>`` (its file name without suffix) and ``tags``: the
    job writes them in once the engine stored the record (the EC connector saves untagged); ``pin`` then
    pins ``tags``. An image skipped as stored keeps the tags it was stored with.

    Unreadable files are reported in ``failed`` and skipped; the job goes on. An engine is started only
    when at least one image needs encoding.
    """
    from tqdm import tqdm

    started = time.perf_counter()
    store_config = patient_config(store_config, store_patience_s)
    summary = PrecomputeSummary(kind="images", total=len(images))
    tags = check_pin_tags(tags, pin)
    config = checked_store_config(store_config)
    ECConnectorOptions.load(store_config)  # a bad option fails here, not in the engine after its start-up
    kwargs = dict(engine_kwargs or {})
    transfer = ec_transfer(store_config)
    vllm_config = engine_config(model, kwargs, **transfer)
    if not vllm_config.model_config.is_multimodal_model:
        raise JobError(f"{model} is not a multimodal model: there is no encoder output to precompute")
    processor = offline_input_processor(vllm_config)
    identity = EncoderIdentity.from_vllm_config(vllm_config, weights=weights_of(vllm_config, config.model_version))
    text = image_prompt(vllm_config)

    # Pass 1: vLLM's mm_hash of every readable image, and which ones are stored already.
    todo: list[tuple[Path, tuple[StoreKey]]] = []
    seen: set[bytes] = set()
    with build_store(config) as store:
        named: list[tuple[Path, StoreKey]] = []
        for path in tqdm(images, desc="hashing images", unit="img", disable=not progress):
            try:
                image = load_image(path)
                request = process_offline(processor, {"prompt": text, "multi_modal_data": {"image": image}})
                (feature,) = request.mm_features
            except Exception as exc:  # any unreadable/unprocessable file is reported, never fatal
                summary.failed.append((path.name, str(exc).removeprefix(f"{path.name}: ")))
                continue
            named.append((path, encoder_key(config.namespace, identity, feature.identifier)))
        present = store.contains_many([key for _, key in named], shared_only=True, bounded=False)
        for (path, key), hit in zip(named, present, strict=True):
            if hit or key.digest in seen:
                summary.skipped += 1
            else:
                seen.add(key.digest)
                todo.append((path, (key,)))

        # Pass 2: one producer engine over what is missing. Pass 3: count what the store really holds now.
        stored_keys = produce(
            store, todo, lambda p: {"prompt": text, "multi_modal_data": {"image": load_image(p)}},
            model=model, engine_kwargs=kwargs, transfer=transfer, batch_size=batch_size, progress=progress,
            desc="encoding images", unit="img",
        )
        count_stored(store, todo, stored_keys, summary, patience_s=store_patience_s,
                     failure="encoded but not found in the store afterwards (see the engine log: dropped write, "
                             "full disk or Redis down)")
        retag(store, todo, lambda path: item_tags("image", path, tags))
    if pin:
        summary.details["pinned"] = pin_after_job(store_config, tags)
    summary.seconds = time.perf_counter() - started
    return summary


# ------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Store the encoder outputs of an image corpus (vLLM ec_producer, encoder only). "
                          "Images already stored are skipped, so a rerun resumes.")
    add_engine_arguments(parser)
    parser.add_argument("--images", required=True, metavar="DIR_OR_LIST",
                        help="a directory of .png/.jpg/.jpeg/.webp files, or a text file with one path per line")
    add_job_tag_arguments(parser)
    add_patience_argument(parser)


def run(args: argparse.Namespace) -> int:
    try:
        store_config = load_store_arg(args.config)
        images = gather_files(Path(args.images), IMAGE_SUFFIXES, "--images")
        if not images:
            return fail(f"--images: no .png/.jpg/.jpeg/.webp file in {args.images!r}")
        summary = precompute_images(args.model, images, store_config, progress=not args.no_progress,
                                    engine_kwargs=engine_kwargs_from_args(args), batch_size=args.batch_size,
                                    tags=args.tags, pin=args.pin, store_patience_s=args.store_patience)
    except (ConfigError, JobError, ValueError) as exc:
        return fail(str(exc))
    return report(summary, args.json)
