"""Background threads of ours that run beside vLLM's forward pass instead of taking turns with it.

vLLM's CPU worker binds its process to the cores its OpenMP threads compute on, and leaves
``VLLM_CPU_NUM_OF_RESERVED_CPU`` cores to the engine core process. Every thread started in the worker
inherits that binding, so the KV loader and saver and the store's writer time-shared the forward's own
core. On a 2-core machine, for instance, ``VLLM::Worker`` and every thread in it are allowed on core 0
only, the engine core on 0-1: a load could not overlap the forward, and a miss's saves slowed its own
prefill.

Each of our threads therefore widens its own affinity when it starts: to the cores of this process and
of its parent (the engine core, which vLLM leaves unbound: its busy-wait yields to us there). The kernel
then runs the thread where a core is free. vLLM's own threads keep their binding. Threads whose work
nothing in the step waits for (the KV saver, the store's writer) go further and keep off the forward's
cores altogether where the parent has others: given both, they still took turns with the prefill they
were saving (the figures of a miss that stores, before and after: docs/benchmarks-kv.md).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")


def widen_affinity(*, beside_forward: bool = False) -> set[int] | None:
    """Let the calling thread run on the cores of this process and of its parent; the cores, or None
    where the platform has no affinity calls or refuses (the thread then keeps what it inherited).

    ``beside_forward``: only the parent's cores that this process is not bound to, where there are such
    cores: for work nothing in the step waits for (saves, background writes), which would otherwise take
    turns with the forward pass on its own cores and slow the prefill it saves."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        own = set(os.sched_getaffinity(0))
        try:
            parent = os.sched_getaffinity(os.getppid())
        except OSError:  # the parent is gone or not ours to inspect: keep our own cores
            parent = set()
        cores = (parent - own) if beside_forward and parent - own else own | parent
        os.sched_setaffinity(0, cores)  # 0: the calling thread only, on Linux
        return cores
    except OSError as exc:
        log.debug("tiercache: thread affinity left as inherited (%s)", exc)
        return None


def background_thread(target: Callable[[], object], name: str, *, daemon: bool = True,
                      beside_forward: bool = False) -> threading.Thread:
    """A thread (not yet started) that widens its affinity (`widen_affinity`) before it runs ``target``."""

    def run() -> None:
        widen_affinity(beside_forward=beside_forward)
        target()

    return threading.Thread(target=run, name=name, daemon=daemon)


#: `WorkerThreads` priorities: an urgent item goes ahead of every ordinary one; closing comes after both.
URGENT, ORDINARY, _CLOSING = 0, 1, 2


class WorkerThreads(Generic[Item]):
    """A few daemon `background_thread`s that hand every item `put` to ``handle``, in arrival order, several
    at once: for work that mostly waits on a socket (a far tier's lookups and reads). An item put ``urgent``
    goes ahead of the ordinary ones queued (a far chunk whose request is waiting for it now, behind chunks of
    requests still queued). Started by `start`, or else on the first `put`. An owner whose first `put` comes
    on a thread that must not wait (the scheduler's, the forward's) starts them when it is built: ``Thread.start``
    returns only once the new thread has run, up to half a second on a loaded machine.
    ``handle`` must not raise: a raise ends its thread."""

    def __init__(self, handle: Callable[[Item], object], name: str, count: int) -> None:
        self._handle = handle
        self._name = name
        self._count = count
        #: (priority, arrival, item): arrival order within a priority
        self._queue: queue.PriorityQueue[tuple[int, int, Item | None]] = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._threads)

    def start(self) -> None:
        """Start the threads (once; later calls do nothing)."""
        if not self._threads:
            with self._start_lock:
                if not self._threads:
                    threads = [background_thread(self._loop, f"{self._name}-{i}") for i in range(self._count)]
                    for thread in threads:
                        thread.start()
                    self._threads = threads

    def put(self, item: Item, urgent: bool = False) -> None:
        self.start()
        self._queue.put((URGENT if urgent else ORDINARY, next(self._arrivals), item))

    def _loop(self) -> None:
        while (item := self._queue.get()[2]) is not None:
            self._handle(item)

    def close(self, timeout: float | None = None) -> None:
        """End the threads after what is queued; with ``timeout``, wait that long for each."""
        for _ in self._threads:
            self._queue.put((_CLOSING, next(self._arrivals), None))
        if timeout is not None:
            for thread in self._threads:
                thread.join(timeout=timeout)
