"""The passes both precompute jobs run once they know what is missing: produce it, then check the store.

Why one module: `tiercache precompute images` and `tiercache precompute docs` differ only in how an item
is named (pass 1: an image's encoder key, a document's chunk keys) and how it is prompted. Running the
producer engine over the missing items (pass 2) and counting what the store really holds afterwards
(pass 3) is the same for both, and was written twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tags import with_tags
from vllm_tiercache.shared.store.tiered import TieredStore
from vllm_tiercache.tools.jobs import (
    PrecomputeSummary,
    batches,
    record_sizes,
    shutdown_llm,
    start_llm,
    wait_for_records,
)
from vllm_tiercache.tools.precompute.waits import describe_waits, lookup_patiently, store_waits

#: One item of a job: its file and the store keys of every record it must leave stored.
Item = tuple[Path, Sequence[StoreKey]]


def produce(
    store: TieredStore,
    todo: Sequence[Item],
    prompt: Callable[[Path], Any],
    *,
    model: str,
    engine_kwargs: Mapping[str, Any],
    transfer: Mapping[str, Any],
    batch_size: int,
    progress: bool,
    desc: str,
    unit: str,
    rekey: Callable[[], Sequence[Item]] | None = None,
    transfer_params: Callable[[Path], dict[str, Any] | None] | None = None,
) -> set[StoreKey]:
    """Pass 2: one producer engine over ``todo`` (``max_tokens=1``), then wait for its records.

    Returns the keys seen stored while the engine ran (see `wait_for_records`); the engine is shut down
    before returning, so its workers flush their background writes. Starts nothing when ``todo`` is empty.
    ``rekey``: called once the prompts ran, while the engine still runs; the items (same order) with the
    keys the engine really writes, when only the running engine can tell them (a hybrid model's KV cache
    groups: `vllm_tiercache.tools.precompute.kv`). ``transfer_params``: each item's ``kv_transfer_params``
    (a document's tags, `vllm_tiercache.shared.request_tags`), None for none.
    """
    if not todo:
        return set()
    from tqdm import tqdm
    from vllm import SamplingParams

    llm = start_llm(model, engine_kwargs, **transfer)
    params = SamplingParams(max_tokens=1)
    bar = tqdm(total=len(todo), desc=desc, unit=unit, disable=not progress)
    try:
        for batch in batches(todo, batch_size):
            per_item = [params if transfer_params is None or not (extra := transfer_params(path)) else
                        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": extra}) for path, _ in batch]
            llm.generate([prompt(path) for path, _ in batch], per_item, use_tqdm=False)
            bar.update(len(batch))
        if rekey is not None:
            todo = rekey()
        return wait_for_records(store, [key for _, keys in todo for key in keys])
    finally:
        bar.close()
        shutdown_llm(llm)


def count_stored(store: TieredStore, todo: Sequence[Item], seen: set[StoreKey], summary: PrecomputeSummary,
                 *, failure: str, patience_s: float, stats_dir: str | None = None, role: str = "") -> int:
    """Pass 3: count in ``summary`` the items whose records are all stored; the others fail with ``failure``,
    and what the store did: the tier still down (`lookup_patiently`, which asks again up to ``patience_s``
    while a shared tier is away), or what the producer's patient writes gave up (`store_waits`, from its
    stats files in ``stats_dir`` under ``role``). A job that waited the store out says so in its details.

    A record seen stored while the engine ran counts as stored even when it is gone now: a concurrent
    `tiercache evict` (or another writer's LRU) may have removed it since, which is no failed write.
    Returns how many stored items lost records that way. One batched lookup for all items.
    """
    if not todo:
        return 0
    keys = [key for _, item_keys in todo for key in item_keys]
    present, still_down = lookup_patiently(store, keys, patience_s)
    waits = store_waits(stats_dir, role) if stats_dir else {}
    if waits:
        summary.details["store_waits"] = describe_waits(waits)
    gave_up = [f"the {name} tier gave up {int(w['dropped_writes'])} records after waiting it out "
               f"(--store-patience {patience_s:g}s; see the engine log)" for name, w in waits.items()
               if w["dropped_writes"]]
    failure = "; ".join([failure, *([still_down] if still_down else []), *gave_up])
    sizes = record_sizes(store, keys)
    evicted_since = 0
    offset = 0
    for path, item_keys in todo:
        span = slice(offset, offset + len(item_keys))
        offset += len(item_keys)
        hits = present[span]
        if all(hit or key in seen for key, hit in zip(item_keys, hits, strict=True)):
            summary.stored += 1
            summary.bytes_stored += sum(size or 0 for size in sizes[span])
            evicted_since += not all(hits)
        else:
            summary.failed.append((path.name, failure))
    return evicted_since


def retag(store: TieredStore, todo: Sequence[Item], tags: Callable[[Path], list[str]]) -> int:
    """Write the stored records of ``todo`` again with their item's tags in their meta (an encoder record:
    the EC connector's worker writes no tags); returns how many records were retagged."""
    done = 0
    for path, keys in todo:
        wanted = tags(path)
        records = store.get_many(list(keys))
        items = [(key, rec.tensor, with_tags(rec.meta, wanted)) for key, rec in zip(keys, records, strict=True)
                 if rec is not None and not rec.in_place]
        if items:
            store.put_many(items, always_admit=True)  # precomputed: always reaches every tier
            done += len(items)
    store.flush()
    return done
