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

from vllm_tiercache.shared.store.disk_index import DiskIndex
from vllm_tiercache.shared.store.disk_paths import RecordPaths


def evict_over_capacity(index: DiskIndex, txn: lmdb.Transaction, capacity: int, paths: RecordPaths) -> int:
    """Unlink least recently used records until the total fits ``capacity``; returns how many.

    ``txn`` must be a write transaction of ``index`` (its entries go with the files).
    """
    total = index.total(txn)
    victims = []
    for digest in index.oldest(txn):
        if total <= capacity:
            break
        entry = index.get(txn, digest)
        victims.append(digest)
        if entry is not None:
            total -= entry.size
    for digest in victims:
        index.delete(txn, digest)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(paths.path(digest))
    return len(victims)
