"""The disk tier's byte budget: the records lowest in the index's order (`order`'s ``prefix``, or least
recently used), with their descendants, are unlinked until the directory fits.

Why a module of its own: eviction is the one place where records disappear without being asked to; it
runs inside the caller's index write transaction (the cross-process lock under which files are renamed
into place), so that every process sharing a directory keeps one budget and no reader's adoption of a
file races its unlink.
"""

from __future__ import annotations

import contextlib
import os

import lmdb

from vllm_tiercache.shared.store.control import Control, parse_control
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex
from vllm_tiercache.shared.store.tiers.disk.paths import RecordPaths


def evict_over_capacity(index: DiskIndex, txn: lmdb.Transaction, capacity: int, paths: RecordPaths,
                        pin_budget: int = 0) -> int:
    """Unlink the records lowest in the index's order (`DiskIndex.oldest`), each with its descendants, until
    the total fits ``capacity``; returns how many records went (descendants included).

    ``txn`` must be a write transaction of ``index`` (its entries go with the files). Records of the tags
    pinned now (the index's control entries, read in this very transaction, so every process sharing the
    directory agrees), up to ``pin_budget`` bytes, are skipped while unpinned records remain; a skipped
    record is moved to at least now in the order (without counting an access: `DiskIndex.touch`), so that
    the next eviction does not walk past the pinned corpus again (a pinned record is in use by definition).

    Why descendants go too: a record is found only by a prefix lookup that found its parent first (the
    connector stops at the first miss), so a child kept after its parent is dead weight, and the parent,
    read before its children by every lookup, is the least recently used of its chain. Taking the
    subtree (`DiskIndex.descendants`: O(log n) per record taken) frees that room now instead of after the
    children age out. A pinned descendant within the budget stays, with what is below it (the pin rule
    above: the operator's word outranks reachability).
    """
    total = index.total(txn)
    if total <= capacity:
        return 0
    pinned = pinned_tags(index, txn) if pin_budget > 0 else frozenset()
    victims: dict[bytes, None] = {}  # in eviction order; a dict so that a descendant met later is skipped
    skipped: list[tuple[bytes, int]] = []
    kept: set[bytes] = set()  # pinned records spared, each counted once against the budget
    protected = 0

    def spared(digest: bytes, size: int) -> bool:
        """Whether the pin rule keeps ``digest`` (counted against the budget the first time)."""
        nonlocal protected
        if digest in kept:
            return True
        if pinned and protected + size <= pin_budget and not pinned.isdisjoint(index.get_tags(txn, digest)):
            protected += size
            kept.add(digest)
            skipped.append((digest, size))
            return True
        return False

    sizes: dict[bytes, int] = {}

    def size_of(digest: bytes) -> int:
        """The record's size from the index, read once per eviction (the pin rule and the total both ask)."""
        size = sizes.get(digest)
        if size is None:
            entry = index.get(txn, digest)
            size = sizes[digest] = entry.size if entry is not None else 0
        return size

    def take(digest: bytes, size: int) -> None:
        """``digest`` goes, and every descendant the pin rule does not keep."""
        nonlocal total
        victims[digest] = None
        total -= size
        for below in index.descendants(txn, digest, keep=lambda d: d in victims or spared(d, size_of(d))):
            victims[below] = None
            total -= size_of(below)

    for digest in index.oldest(txn):
        if total <= capacity:
            break
        if digest in victims or digest in kept:
            continue
        size = size_of(digest)
        if spared(digest, size):
            continue
        take(digest, size)
    for digest, size in skipped:
        if digest in victims:
            continue
        if total > capacity:  # nothing unpinned was left: pinned records go too, oldest first
            kept.discard(digest)
            take(digest, size)
        else:
            index.touch(txn, digest, index.clock(), access=False)
    for digest in victims:
        index.delete(txn, digest)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(paths.path(digest))
    return len(victims)


#: the last control entries read and the tags they pin (most evictions find them unchanged)
_PINS_SEEN: tuple[tuple[tuple[str, bytes], ...], Control] | None = None


def pinned_tags(index: DiskIndex, txn: lmdb.Transaction) -> frozenset[str]:
    """The tags pinned now, from the index's control entries (parsed again only when they changed)."""
    global _PINS_SEEN
    entries = tuple(sorted(index.control_entries(txn).items()))
    if not entries:
        return frozenset()
    seen = _PINS_SEEN
    if seen is None or seen[0] != entries:
        seen = _PINS_SEEN = (entries, parse_control(dict(entries)))
    return seen[1].pinned_now()
