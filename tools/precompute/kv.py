"""`tiercache precompute docs`: store the KV prefix of every document before serving RAG queries on it.

A RAG request is ``rag_prompt(document, question, template)``: the document (optionally wrapped in a
template, and with its image when ``name.png`` sits beside ``name.txt`` and the model is multimodal),
then the question. The job runs vLLM as a `kv_producer` over ``rag_prompt(document, None, template)``
with ``max_tokens=1``, so the store holds the KV chunks of exactly the prefix that serving requests
share. Serving must build its prompts with the same `rag_prompt` and run with the same model, dtype,
block size, chunk size and namespace.

Resume: before starting an engine, every document's chunk keys are computed offline with vLLM's own
input processor (tokenizer, multimodal processor and mm_hash) and the connector's own naming
(`vllm_tiercache.kvcache.naming.KVNaming`), exactly as the engine's scheduler names them; documents whose
chunks are all stored are skipped.

Hybrid models (Gemma 3's sliding-window layers, vLLM's hybrid KV cache manager): a sliding-window
layer's records carry its KV cache group in their keys, and the groups are known only to a running
engine. The producer engine's connector reports them (its stats file, `$TIERCACHE_STATS_DIR`); the job
names the records from them and remembers them for the next run (`EngineGroups`), so a rerun skips what
is stored. Before the groups are known, offline naming asks for records such a model never writes, so
no document is wrongly skipped: they are all prefilled.

What a serving prompt can reuse: every full block of the prefix. The connector names a chunk by the
hash of its last block; a serving prompt that extends the document finds its full chunks directly and
its partial last chunk by probing the shorter chunk endings after the last full-chunk hit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_tiercache.kvcache.groups import KVGroups
from vllm_tiercache.kvcache.naming import KVNaming
from vllm_tiercache.kvcache.options import KVConnectorOptions
from vllm_tiercache.shared.config import ConfigError
from vllm_tiercache.shared.files import replace_json
from vllm_tiercache.shared.request_tags import TAGS_PARAM
from vllm_tiercache.shared.stats_dump import ENV_VAR as STATS_DIR_ENV
from vllm_tiercache.shared.stats_dump import read_stats
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tier_config import default_cache_dir
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
from vllm_tiercache.tools.precompute.passes import count_stored, produce
from vllm_tiercache.tools.precompute.tagging import add_job_tag_arguments, check_pin_tags, item_tags, pin_after_job
from vllm_tiercache.tools.precompute.waits import DEFAULT_STORE_PATIENCE_S, add_patience_argument, patient_config

log = logging.getLogger(__name__)

#: Placeholder a template must contain; replaced verbatim (documents may contain braces).
DOCUMENT_PLACEHOLDER = "{document}"
#: Images looked for beside ``name.txt`` (first match wins).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
#: What follows the shared prefix in a serving request (BLIP-2's VQA prompt format in vLLM 0.32).
QUESTION_SUFFIX = "\n\nQuestion: {question} Answer:"


def rag_prompt(document_text: str, question: str | None = None, template: str | None = None) -> str:
    """The text of a RAG request: template(document), then the question (None: the prefix alone).

    One function for the precompute job and for serving, so the stored prefix is a prefix of every
    serving prompt. Trailing whitespace of the wrapped document is dropped and the question part starts
    with a newline: BPE tokenizers merge runs of whitespace, so a prefix ending in whitespace would
    tokenize differently alone than followed by the question. With an image (BLIP-2), vLLM inserts the
    image's placeholder tokens at the start of the prompt, so pass the image as ``multi_modal_data`` of
    both the precompute and the serving request; the prompt text is the same.
    """
    if template is not None and DOCUMENT_PLACEHOLDER not in template:
        raise ValueError(f"the template has no {DOCUMENT_PLACEHOLDER} placeholder")
    body = template.replace(DOCUMENT_PLACEHOLDER, document_text) if template else document_text
    body = body.rstrip()
    return body if question is None else body + QUESTION_SUFFIX.format(question=question)


def doc_image(doc: Path) -> Path | None:
    """``name.png`` (or .jpg/.jpeg/.webp) beside ``name.txt``, if any."""
    for suffix in IMAGE_SUFFIXES:
        candidate = doc.with_suffix(suffix)
        if candidate.is_file():
            return candidate
    return None


def doc_request(doc: Path, template: str | None, *, multimodal: bool, question: str | None = None,
                salt: str | None = None) -> dict[str, Any]:
    """The vLLM prompt dict for a document (with its image when the model takes images); ``salt``: the
    tenant's ``cache_salt``, which enters vLLM's block hashes (the records' keys) and seals the records
    for that tenant in a sealing store, so only that tenant's requests (same salt) hit them."""
    from vllm_tiercache.tools.precompute.ec import load_image

    prompt: dict[str, Any] = {"prompt": rag_prompt(doc.read_text(), question, template)}
    if salt is not None:
        prompt["cache_salt"] = salt
    image = doc_image(doc) if multimodal else None
    if image is not None:
        prompt["multi_modal_data"] = {"image": load_image(image)}
    return prompt


class EngineGroups:
    """The producer engine's KV cache groups: remembered per model and engine, read from a running engine.

    Why: the keys of a hybrid model's records name their KV cache group, which vLLM decides when the
    engine builds its KV cache; offline naming knows none. The file under the tiercache cache dir is keyed
    by what decides the groups (the model's fingerprint, block size, vLLM version, whether the hybrid KV
    cache manager is off), so a stale file is never read for another engine.
    """

    def __init__(self, vllm_config: Any, naming: KVNaming, cache_dir: Path | None = None) -> None:
        import vllm

        scheduler = vllm_config.scheduler_config
        ident = json.dumps([naming.identities[0].fingerprint, naming.geometry.block_size, vllm.__version__,
                            bool(getattr(scheduler, "disable_hybrid_kv_cache_manager", False))])
        name = hashlib.blake2b(ident.encode(), digest_size=12).hexdigest()
        self.path = (cache_dir or default_cache_dir()) / "kv-groups" / f"{name}.json"

    def remembered(self) -> KVGroups | None:
        try:
            return KVGroups.from_json(json.loads(self.path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remember(self, groups: KVGroups) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_json(self.path, groups.to_json())
        except OSError as exc:  # a rerun then prefills again: slower, never wrong
            log.warning("tiercache precompute: cannot remember the engine's KV cache groups in %s: %s",
                        self.path, exc)

    @staticmethod
    def of_running_engine(stats_dir: str, timeout_s: float = 30.0) -> KVGroups | None:
        """The groups the engine's KV worker reports in its stats file (written every step)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for payload in read_stats(stats_dir, "kv-worker"):
                if isinstance(payload.get("groups"), dict):
                    return KVGroups.from_json(payload["groups"])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)


def _nothing_to_store(model: str, groups: KVGroups) -> JobError:
    return JobError(f"{model}: TieredKVConnector stores no KV for this model ({groups.unsupported}); there is "
                    "nothing to precompute")


@contextlib.contextmanager
def _stats_dir() -> Iterator[str]:
    """`$TIERCACHE_STATS_DIR` for the producer engine: the caller's, or a temporary one for this job."""
    if os.environ.get(STATS_DIR_ENV):
        yield os.environ[STATS_DIR_ENV]
        return
    with tempfile.TemporaryDirectory(prefix="tiercache-precompute-") as tmp:
        os.environ[STATS_DIR_ENV] = tmp
        try:
            yield tmp
        finally:
            os.environ.pop(STATS_DIR_ENV, None)


def precompute_docs(
    model: str,
    docs: list[Path],
    store_config: dict[str, Any],
    *,
    template: str | None,
    progress: bool = True,
    engine_kwargs: dict[str, Any] | None = None,
    batch_size: int = DEFAULT_BATCH,
    tags: Sequence[str] = (),
    pin: bool = False,
    salt: str | None = None,
    store_patience_s: float = DEFAULT_STORE_PATIENCE_S,
) -> PrecomputeSummary:
    """Store the KV prefix chunks of every document whose chunks are not all stored yet.

    The store is patient (``store_patience_s``, `vllm_tiercache.tools.precompute.waits`): a tier that is
    slow, down or throttling is waited out, and a document fails only once it wrote nothing for that long.

    Each document's records carry the tags ``doc:<name>`` (its file name without ``.txt``) and ``tags``,
    given to the producer engine through the request's ``kv_transfer_params`` (the serving path's
    ``tiercache_tags``); ``pin`` then pins ``tags`` (`vllm_tiercache.tools.pin_cmd`). A document skipped
    as stored keeps the tags it was stored with.

    Unreadable documents, prompts longer than ``max_model_len`` and documents shorter than one block
    are reported in ``failed``; the job goes on. An engine starts only when some document needs it.
    """
    from tqdm import tqdm
    from vllm.config import KVTransferConfig

    started = time.perf_counter()
    store_config = patient_config(store_config, store_patience_s)
    summary = PrecomputeSummary(kind="docs", total=len(docs))
    tags = check_pin_tags(tags, pin)
    if template is not None and DOCUMENT_PLACEHOLDER not in template:
        raise JobError(f"--template: the template has no {DOCUMENT_PLACEHOLDER} placeholder; add it where "
                       "the document text goes")
    config = checked_store_config(store_config)
    options, _ = KVConnectorOptions.load(store_config)
    kwargs = dict(engine_kwargs or {})
    transfer = {"kv_transfer_config": KVTransferConfig(
        kv_connector="TieredKVConnector", kv_role="kv_producer",
        kv_connector_extra_config=write_through(store_config))}
    vllm_config = engine_config(model, kwargs, **transfer)
    naming = KVNaming.from_configs(vllm_config, config, options)
    engine_groups = EngineGroups(vllm_config, naming)
    remembered = engine_groups.remembered()
    if remembered is not None:
        if not remembered.supported:
            raise _nothing_to_store(model, remembered)
        naming = dataclasses.replace(naming, kv_groups=remembered)
    multimodal = bool(vllm_config.model_config.is_multimodal_model)
    processor = offline_input_processor(vllm_config)
    max_len = int(vllm_config.model_config.max_model_len)
    ignored_images = 0
    tokens_total = reusable_total = 0
    misaligned: list[str] = []

    todo: list[tuple[Path, list[StoreKey]]] = []
    requests: dict[Path, Any] = {}
    with build_store(config) as store, _stats_dir() as stats_dir:
        for doc in tqdm(docs, desc="hashing docs", unit="doc", disable=not progress):
            try:
                if not multimodal and doc_image(doc) is not None:
                    ignored_images += 1
                request = process_offline(processor, doc_request(doc, template, multimodal=multimodal, salt=salt))
                probe = process_offline(processor, doc_request(doc, template, multimodal=multimodal, salt=salt,
                                                                question="?"))
            except Exception as exc:  # unreadable text/image, or rejected by vLLM (too long...)
                summary.failed.append((doc.name, str(exc)))
                continue
            ids = list(request.prompt_token_ids)
            if len(ids) >= max_len:
                summary.failed.append((doc.name, f"{len(ids)} prompt tokens, not below max_model_len={max_len}; "
                                                 "raise --max-model-len or split the document"))
                continue
            if list(probe.prompt_token_ids[: len(ids)]) != ids:
                misaligned.append(doc.name)
            keys, reusable = naming.prompt_keys(request)
            if not keys:
                summary.failed.append((doc.name, f"{len(ids)} tokens: shorter than one block "
                                                 f"({naming.geometry.block_size} tokens), nothing to cache"))
                continue
            tokens_total += len(ids)
            reusable_total += reusable
            if all(store.contains_many(keys, shared_only=True, bounded=False)):
                summary.skipped += 1
            else:
                todo.append((doc, keys))
                requests[doc] = request

        unsupported: KVGroups | None = None

        def engine_keys() -> list[tuple[Path, list[StoreKey]]]:
            """The items named with the running engine's KV cache groups (remembered for the next run)."""
            nonlocal naming, todo, unsupported
            groups = EngineGroups.of_running_engine(stats_dir)
            if groups is None:
                log.warning("tiercache precompute: the engine reported no KV cache groups; documents are "
                            "checked with offline naming")
                return todo
            engine_groups.remember(groups)
            if not groups.supported:
                unsupported = groups
            elif groups != naming.groups:
                naming = dataclasses.replace(naming, kv_groups=groups)
                todo = [(doc, naming.prompt_keys(requests[doc])[0]) for doc, _ in todo]
            return todo

        seen = produce(
            store, todo, lambda doc: doc_request(doc, template, multimodal=multimodal, salt=salt),
            model=model, engine_kwargs=kwargs, transfer=transfer, batch_size=batch_size, progress=progress,
            desc="prefilling docs", unit="doc", rekey=engine_keys,
            transfer_params=lambda doc: {TAGS_PARAM: item_tags("doc", doc, tags)},
        )
        if unsupported is not None:
            raise _nothing_to_store(model, unsupported)
        evicted_since = count_stored(
            store, todo, seen, summary, patience_s=store_patience_s, stats_dir=stats_dir, role="kv-worker",
            failure="prefilled but some chunks are not in the store afterwards (see the engine log: dropped "
                    "write, full disk or Redis down)",
        )
    summary.details["tokens"] = f"{tokens_total} prefix tokens, {reusable_total} reusable by longer prompts"
    if evicted_since:
        summary.details["evicted"] = (f"{evicted_since} stored docs lost chunks to eviction before the job ended "
                                      "(a concurrent `tiercache evict` or LRU); the next run stores them again")
    if ignored_images:
        summary.details["images"] = f"{ignored_images} images beside docs ignored: {model} is text-only"
    if misaligned:
        summary.details["warning"] = (f"{len(misaligned)} docs tokenize differently once a question follows "
                                      f"(e.g. {misaligned[0]}); their last tokens will not hit")
    if pin:
        summary.details["pinned"] = pin_after_job(store_config, tags)
    summary.seconds = time.perf_counter() - started
    return summary


# ------------------------------------------------------------------------------------------------- CLI
def salt_arg(text: str) -> str:
    """``--salt``: the value itself, or ``env:NAME``'s value; a missing variable or an empty salt is refused."""
    if text.startswith("env:"):
        value = os.environ.get(text[4:])
        if value is None:
            raise argparse.ArgumentTypeError(f"environment variable {text[4:]!r} is not set; allowed: a salt, or "
                                             "env:NAME naming a set variable")
        text = value
    if not text:
        raise argparse.ArgumentTypeError("an empty salt; allowed: the tenant's non-empty cache_salt")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Store the KV prefix chunks of a document corpus (vLLM kv_producer, max_tokens=1). "
                          "Documents whose chunks are all stored are skipped, so a rerun resumes.")
    add_engine_arguments(parser)
    parser.add_argument("--docs", required=True, metavar="DIR_OR_LIST",
                        help="a directory of .txt files (name.png beside name.txt joins the prompt of a "
                             "multimodal model), or a text file with one path per line")
    parser.add_argument("--template", default=None, metavar="FILE",
                        help=f"template file with a {DOCUMENT_PLACEHOLDER} placeholder (serving must use it too)")
    add_job_tag_arguments(parser)
    add_patience_argument(parser)
    parser.add_argument("--salt", default=None, type=salt_arg, metavar="SALT",
                        help="the tenant's cache_salt (or env:NAME to read it from an environment variable, kept "
                             "out of the process list): the corpus is stored for that tenant only; serving "
                             "requests hit it only with the same salt, set by the gateway")


def run(args: argparse.Namespace) -> int:
    try:
        store_config = load_store_arg(args.config)
        template = None
        if args.template:
            try:
                template = Path(args.template).read_text()
            except OSError as exc:
                return fail(f"--template: cannot read {args.template!r} ({exc.strerror})")
        docs = gather_files(Path(args.docs), (".txt",), "--docs")
        if not docs:
            return fail(f"--docs: no .txt file in {args.docs!r}")
        summary = precompute_docs(args.model, docs, store_config, template=template,
                                  progress=not args.no_progress, engine_kwargs=engine_kwargs_from_args(args),
                                  batch_size=args.batch_size, tags=args.tags, pin=args.pin,
                                  salt=args.salt, store_patience_s=args.store_patience)
    except (ConfigError, JobError, ValueError) as exc:
        return fail(str(exc))
    return report(summary, args.json)
