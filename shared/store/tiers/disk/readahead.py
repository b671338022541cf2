"""Read-ahead of the disk tier: the kernel is told (``POSIX_FADV_WILLNEED``) which record files will be read.

Why: a load reads its records one after another; from a cold disk each read waited for the device
alone. Advised ahead, the reads of a whole step are queued at once while the first layer loads. Where a
read can tell a page-cache miss (``RWF_NOWAIT``), the advice is deferred until a read finds a file that is
not wholly in the page cache, and never given for a step whose files are all there: the advice costs an
open, an fadvise and a close per file, and a warm read needs none of it (figures: docs/benchmarks-kv.md).
A ``RWF_NOWAIT`` read that misses starts the kernel's own read-ahead of that file, which may finish before
the read looks again: then the read succeeds and no advice is given, the file being in the page cache.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from typing import Any

from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tiers.disk.paths import RecordPaths

#: ``preadv`` flag: serve the read from the page cache or fail at once (Linux); None where absent.
NOWAIT = getattr(os, "RWF_NOWAIT", None) if hasattr(os, "posix_fadvise") else None


class ReadAhead:
    """The keys each thread was told it will read next, and the advice to the kernel about their files."""

    def __init__(self, paths: RecordPaths) -> None:
        self.paths = paths
        #: per thread: the keys `prefetch` was told of and has not advised the kernel of yet
        self._upcoming = threading.local()
        #: reads can tell a page-cache miss (`NOWAIT`); off for good once the filesystem refuses the flag
        self.nowait = NOWAIT is not None

    def prefetch(self, keys: Sequence[StoreKey]) -> None:
        """These records' files will be read soon, by this thread, in this order: remember them for the
        first read that finds a file cold (`read_cached`), or advise at once where reads cannot tell."""
        if self.nowait:
            self._upcoming.keys = list(keys)
        else:
            self.advise(keys)

    def has_upcoming(self) -> bool:
        """Whether this thread holds keys whose advice was deferred."""
        return bool(getattr(self._upcoming, "keys", None))

    def advise_upcoming(self) -> None:
        """Give the read-ahead advice `prefetch` deferred, once."""
        keys = getattr(self._upcoming, "keys", None)
        if keys:
            self._upcoming.keys = None
            self.advise(keys)

    def read_cached(self, fd: int, buffers: list[Any]) -> int:
        """``preadv`` from offset 0 that only takes what the page cache holds now: the bytes read, fewer
        than the file's (or -1) when some of it would have to come from the device."""
        try:
            return os.preadv(fd, buffers, 0, NOWAIT)
        except BlockingIOError:
            return -1
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self.nowait = False  # this filesystem cannot say: advise at once from now on
            return -1

    def advise(self, keys: Sequence[StoreKey]) -> None:
        """Ask the kernel to read these records' files ahead (a key not stored is skipped)."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        for key in keys:
            try:
                fd = os.open(self.paths.path_text(key.digest), os.O_RDONLY)
            except OSError:
                continue  # not stored here: the read will miss
            try:
                advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
