"""Where the record files of one disk-tier directory live: ``root/ab/abcdef....rec``, named by key digest.

Why a module of its own: every part of the disk tier (reads, read-ahead, writes, eviction, the index's
bookkeeping) turns digests into paths, and the layout must be one rule. File names are the key digest in a
two-level fan-out, never key text, so no key can turn into a path and directories stay small.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from vllm_tiercache.shared.store.api import KEY_DIGEST_SIZE

#: Leftover temp files (from a killed writer) older than this are removed when a tier opens.
STALE_TMP_S = 600


class RecordPaths:
    """The file layout of one tier directory (nothing here touches the index)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root_text = str(root)

    def path(self, digest: bytes) -> Path:
        """The record file of a key digest."""
        h = digest.hex()
        return self.root / h[:2] / f"{h}.rec"

    def path_text(self, digest: bytes) -> str:
        """`path` as text, for the read path (building a `Path` per record cost more than its read's
        syscalls)."""
        h = digest.hex()
        return f"{self._root_text}/{h[:2]}/{h}.rec"

    @staticmethod
    def temp_path(final: Path) -> Path:
        """A fresh temp file beside ``final``: same directory, so the rename into place is atomic, and a
        random tail, so writers in several processes never share one."""
        return final.parent / f".tmp-{final.stem}-{uuid.uuid4().hex[:12]}"

    def record_files(self) -> Iterator[Path]:
        """Every record file of the directory (temp files excluded)."""
        return self.root.glob("??/*.rec")

    def sweep(self, older_than_s: float = STALE_TMP_S) -> list[bytes]:
        """Remove the temp files a killed writer left behind (old enough that no live writer still owns
        them) and return the digests of the record files, in one pass over the directory (when a tier opens:
        `bookkeeping.adopt_unindexed` indexes the records a killed writer left unindexed)."""
        cutoff = time.time() - older_than_s
        digests = []
        try:
            fan_out = [e.path for e in os.scandir(self.root) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        for folder in fan_out:
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        name = entry.name
                        if name.endswith(".rec"):
                            digest = key_named_by(Path(name))
                            if digest is not None:
                                digests.append(digest)
                        elif name.startswith(".tmp-"):
                            with contextlib.suppress(OSError):
                                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                                    os.unlink(entry.path)
            except OSError:
                continue
        return digests


def key_named_by(path: Path) -> bytes | None:
    """The key digest a record file is named by, or None for a file name that is not one."""
    try:
        digest = bytes.fromhex(path.stem)
    except ValueError:
        return None
    return digest if len(digest) == KEY_DIGEST_SIZE else None
