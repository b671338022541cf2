"""What a starting engine announces before its first request: the journal's chunks the shared tiers still hold.

Why on a thread started with the scheduler, and applied on the first step: vLLM publishes events only
from its step loop, so nothing reaches a router before the first request whatever we do; but everything
found by then goes out with that first step. The ring (`vllm_tiercache.kvcache.events.journal`) is read
and every entry checked against the shared tiers (every record of the chunk, in batches of ``batch``
chunks) while the engine finishes starting and the API server comes up, which takes seconds; the first
step waits for a check still running at most ``FIRST_STEP_WAIT_S``, and a later step applies it when it
is done. The ledger then publishes at most its per-step block budget, so a full ring (4,096 chunks) goes
out over the first few steps.

A shared tier that does not answer at start (Redis down or hung, the object tier's server hung: each
request gives up after the tier's ``timeout_s`` and marks it down) is no reason to wait: what it did not
find is asked again once it answers (the tracker's unreachable set), and the journal's writes continue
after a sequence number taken from the clock, past any counter an earlier run reached. A ring it could
not read at all (``ring_read`` False) is read and checked again, on a thread like this one, once every
shared tier answers: without that, what a stopped engine saved was announced only as lookups found it
whenever its store hung while the next engine started (tests/kv/events/test_startup_hangs.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_tiercache.kvcache.events.journal import EventJournal
from vllm_tiercache.kvcache.events.ledger import ChunkPayload
from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)

#: The most the first engine step waits for a start-up check still running (then a later step applies it).
FIRST_STEP_WAIT_S = 1.0


@dataclass
class Discovered:
    """The start-up check's answer: each journal entry (oldest first, one per chunk), whether the shared
    tiers hold every record of it, whether they all answered throughout, and whether they all answered
    while the ring was read (False: some of it may be unread, so it is to be read again once they answer)."""

    entries: list[tuple[bytes, ChunkPayload]] = field(default_factory=list)
    held: list[bool] = field(default_factory=list)
    answering: bool = True
    ring_read: bool = True


class StartupDiscovery:
    """The journal read and checked on a thread of its own, started at once (see the module docstring)."""

    def __init__(self, journal: EventJournal, held: Callable[[Sequence[bytes]], list[bool]],
                 answering: Callable[[], bool], *, batch: int = 256) -> None:
        self.journal = journal
        self._held = held
        self._answering = answering
        self.batch = batch
        self._done = threading.Event()
        self._answer: Discovered | None = None
        background_thread(self._run, "tiercache-kv-discovery").start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            answering = self._answering()
            entries, next_seq = self.journal.read_ring()
            ring_read = answering = answering and self._answering()
            # a tier that did not answer may hold newer segments than those read: continue past any of them
            self.journal.continue_at(next_seq if answering else max(next_seq, int(time.time())))
            latest = {name: payload for name, payload in entries}  # one entry per chunk, its last
            unique = [(name, latest.pop(name)) for name, _ in entries if name in latest]
            held: list[bool] = []
            for start in range(0, len(unique), self.batch):
                held += self._held([name for name, _ in unique[start:start + self.batch]])
            self._answer = Discovered(unique, held, answering and self._answering(), ring_read)
            # the line says when the check ended, and how long it took: a first step before it announces
            # none of it (it waits at most FIRST_STEP_WAIT_S), the next step after it all of it
            log.info("tiercache: KV events journal: %d of %d journaled chunks still held by the shared tiers "
                     "(checked in %.2f s)%s", sum(held), len(unique), time.monotonic() - started,
                     "" if ring_read else "; a shared tier did not answer: read again once it does")
        except Exception as exc:  # a tier down or broken at start: nothing announced now; later writes go on
            log.warning("tiercache: could not read the KV events journal at start (%s); chunks are announced as "
                        "lookups find them, and the journal is read again once the shared tiers answer", exc)
            self.journal.continue_at(int(time.time()))
            # read again once the tiers answer, if they did not now; a tier that answers and still fails
            # the read is not asked again and again
            self._answer = Discovered(answering=False, ring_read=self._answering())
        finally:
            self._done.set()

    def result(self, timeout: float = 0.0) -> Discovered | None:
        """The answer once the check is done (waiting at most ``timeout``), else None."""
        return self._answer if self._done.wait(timeout) else None
