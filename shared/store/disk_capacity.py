"""The disk tier's byte budget: least recently used records are unlinked until the directory fits.

Why a module of its own: eviction is the one place where records disappear without being asked to; it
runs inside the caller's index write transaction (the cross-process lock under which files are renamed
into place), so that every process sharing a directory keeps one budget and no reader's adoption of a
file races its unlink.
"""

from __future__ import annotations

import contextlib
import os

import lmdb

from vllm_tiercache.shared.store.control import parse_control
from vllm_tiercache.shared.store.disk_index import DiskIndex
from vllm_tiercache.shared.store.disk_paths import RecordPaths


def evict_over_capacity(index: DiskIndex, txn: lmdb.Transaction, capacity: int, paths: RecordPaths,
                        pin_budget: int = 0) -> int:
    """Unlink least recently used records until the total fits ``capacity``; returns how many.

    ``txn`` must be a write transaction of ``index`` (its entries go with the files). Records of the tags
    pinned now (the index's control entries, read in this very transaction, so every process sharing the
    directory agrees), up to ``pin_budget`` bytes, are skipped while unpinned records remain.
    """
    total = index.total(txn)
    if total <= capacity:
        return 0
    protected = pinned_digests(index, txn, pin_budget)
    victims: list[bytes] = []
    chosen: set[bytes] = set()
    for protect in (True, False):  # unpinned records first; pinned ones only if nothing else is left
        for digest in index.oldest(txn):
            if total <= capacity:
                break
            if (digest in protected) == protect or digest in chosen:
                continue
            entry = index.get(txn, digest)
            victims.append(digest)
            chosen.add(digest)
            if entry is not None:
                total -= entry.size
        if total <= capacity or not protected:
            break
    for digest in victims:
        index.delete(txn, digest)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(paths.path(digest))
    return len(victims)


def pinned_digests(index: DiskIndex, txn: lmdb.Transaction, budget: int) -> set[bytes]:
    """The records eviction must skip: those of a tag pinned now, oldest tag first, up to ``budget`` bytes."""
    if budget <= 0:
        return set()
    pinned = parse_control(index.control_entries(txn)).pinned_now()
    if not pinned:
        return set()
    protected: set[bytes] = set()
    for digest, tags in index.scan_tags(txn):
        if pinned.isdisjoint(tags):
            continue
        entry = index.get(txn, digest)
        if entry is None or entry.size > budget:
            continue  # an orphan, or beyond the budget: evictable
        protected.add(digest)
        budget -= entry.size
    return protected
