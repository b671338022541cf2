"""The store's shared control entries: invalidations by tag and pins, and the thread that polls them.

Why: `tiercache evict --tag` and `tiercache pin` run in another process than the engines, and a memory
tier lives inside each engine, where no admin command reaches it. So the commands write small entries
into every shared tier that keeps them (`KeepsControl`: disk, the index's ``control`` database; Redis, the
hash ``{key_prefix}control``), and every `TieredStore` polls them on a background thread every
``control_poll_s`` seconds (`ControlPoller`):

- ``invalidate:<tag>`` -> when the invalidation was made: the memory tier (`DropsTagged`) drops the
  records of that tag written before then. A memory tier therefore stops serving an invalidated tag at
  most ``control_poll_s`` (plus one poll's duration) after the command returns.
- ``pin:<tag>`` -> when it was pinned and until when (or for ever): the tiers that keep pinned records
  (`HonorsPins`) are told the tags pinned now; the disk tier reads the pins in its own index transaction
  when it evicts (`pinned_tags`). An expired pin is removed by the one process whose `remove_control`
  call removes it, which gives Redis records their TTL back (`ExpiresRecords`).

A tier that cannot be read (Redis down, hung past its timeout, failing over) counts with what it said
at its last good read: a pin it holds stays in force in every memory tier through the outage (a poll that
forgot it would let one-off traffic evict the pinned corpus), and an invalidation it holds that this
process has not applied yet is applied once the tier answers again.

Every value is versioned and checksummed (``TCC1`` | u32 xxh32 | JSON); one that does not check is
ignored (logged once), never trusted. An older build never reads these entries.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)

INVALIDATE = "invalidate:"
PIN = "pin:"
_MAGIC = b"TCC1"
_SUM = struct.Struct("<I")
#: Invalidations older than this are dropped by the next command that writes one: every memory copy they
#: were meant for has been polled away long before.
INVALIDATION_KEEP_S = 7 * 86400.0


def encode_value(body: Mapping[str, Any]) -> bytes:
    """A control value: magic, checksum, JSON body."""
    raw = json.dumps(dict(body), sort_keys=True, separators=(",", ":")).encode()
    return _MAGIC + _SUM.pack(xxhash.xxh32_intdigest(raw)) + raw


def decode_value(value: bytes) -> dict[str, Any] | None:
    """A control value's body; None when it is not one of ours or does not check."""
    head = len(_MAGIC) + _SUM.size
    if len(value) < head or value[:len(_MAGIC)] != _MAGIC:
        return None
    raw = value[head:]
    if _SUM.unpack_from(value, len(_MAGIC))[0] != xxhash.xxh32_intdigest(raw):
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


@dataclass
class Control:
    """What the control entries of the shared tiers say, merged."""

    #: tag -> unix time: records of that tag written before it are gone
    invalidations: dict[str, float] = field(default_factory=dict)
    #: tag -> unix time the pin ends (None: never)
    pins: dict[str, float | None] = field(default_factory=dict)

    def pinned_now(self, now: float | None = None) -> frozenset[str]:
        now = time.time() if now is None else now
        return frozenset(tag for tag, until in self.pins.items() if until is None or until > now)

    def expired_pins(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        return [tag for tag, until in self.pins.items() if until is not None and until <= now]


def parse_control(entries: Mapping[str, bytes], into: Control | None = None) -> Control:
    """Merge one tier's entries into ``into`` (a later invalidation wins; a pin without end wins)."""
    out = into if into is not None else Control()
    for name, value in entries.items():
        body = decode_value(value)
        if body is None:
            log.warning("tiercache: control entry %r does not check; ignored", name)
            continue
        if name.startswith(INVALIDATE) and isinstance(body.get("at"), (int, float)):
            tag = name[len(INVALIDATE):]
            out.invalidations[tag] = max(float(body["at"]), out.invalidations.get(tag, 0.0))
        elif name.startswith(PIN):
            tag, until = name[len(PIN):], body.get("until")
            until = float(until) if isinstance(until, (int, float)) else None
            if tag in out.pins and (out.pins[tag] is None or until is None):
                out.pins[tag] = None
            else:
                out.pins[tag] = max(until or 0.0, out.pins.get(tag) or 0.0) if until is not None else None
    return out


def invalidation_changes(tags: Iterable[str], at: float, old: Mapping[str, bytes]) -> dict[str, bytes | None]:
    """The entries `tiercache evict --tag` writes: one per tag, and old ones past `INVALIDATION_KEEP_S` removed."""
    changes: dict[str, bytes | None] = {}
    for name, value in old.items():
        body = decode_value(value)
        if name.startswith(INVALIDATE) and body is not None and at - float(body.get("at", at)) > INVALIDATION_KEEP_S:
            changes[name] = None
    for tag in tags:
        changes[INVALIDATE + tag] = encode_value({"at": at})
    return changes


def pin_changes(tags: Iterable[str], until: float | None, pin: bool) -> dict[str, bytes | None]:
    """The entries `tiercache pin` (``pin``) or `tiercache unpin` writes."""
    now = time.time()
    return {PIN + tag: encode_value({"at": now, "until": until}) if pin else None for tag in tags}


class ControlPoller:
    """Reads the control entries of the shared tiers every ``interval_s`` and applies them to this
    process's tiers: invalidations to `DropsTagged` tiers (each once), pins to `HonorsPins` tiers, and
    an expired pin's clean-up to `ExpiresRecords` tiers (by the process that claims it)."""

    def __init__(self, tiers: Sequence[Any], interval_s: float) -> None:
        from vllm_tiercache.shared.store.api import DropsTagged, ExpiresRecords, HonorsPins, KeepsControl

        self.sources = [t for t in tiers if isinstance(t, KeepsControl)]
        self.droppers = [t for t in tiers if isinstance(t, DropsTagged)]
        self.pinners = [t for t in tiers if isinstance(t, HonorsPins)]
        self.expirers = [t for t in tiers if isinstance(t, ExpiresRecords)]
        self.interval_s = interval_s
        self.applied: dict[str, float] = {}
        self.polls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        #: each source's entries at its last good read (tier name -> entries): what it counts with while
        #: it cannot be read
        self._last_read: dict[str, Mapping[str, bytes]] = {}

    def start(self) -> None:
        """Start polling (a no-op when no tier keeps control entries)."""
        if self.sources and self._thread is None:
            self._thread = background_thread(self._loop, "tiercache-control")
            self._thread.start()

    def poll(self) -> Control:
        """One pass: read, merge, apply. Never raises (a tier that cannot be read is skipped)."""
        control = Control()
        for tier in self.sources:
            if self._stop.is_set():  # closing: the tiers are about to close
                return control
            try:
                self._last_read[tier.name] = tier.read_control()
            except Exception as exc:  # an unreachable Redis: its last good read counts meanwhile
                if tier.name not in self._warned:  # info: a tier that is down says so itself, loudly
                    self._warned.add(tier.name)
                    log.info("tiercache: control entries of tier %s not read (%s); its last read counts "
                             "meanwhile, retried every poll", tier.name, exc)
            parse_control(self._last_read.get(tier.name, {}), control)
        fresh = {tag: at for tag, at in control.invalidations.items() if self.applied.get(tag, 0.0) < at}
        if fresh:
            for tier in self.droppers:
                tier.drop_tagged(fresh)
            self.applied.update(fresh)
        pinned = control.pinned_now()
        for tier in self.pinners:
            tier.set_pinned_tags(pinned)
        for tag in control.expired_pins():
            self._end_pin(tag)
        self.polls += 1
        return control

    def _end_pin(self, tag: str) -> None:
        claimed = False
        for tier in self.sources:
            try:
                claimed = tier.remove_control(PIN + tag) or claimed
            except Exception:
                continue
        if not claimed:
            return
        for tier in self.expirers:
            try:
                tier.hold_tagged([tag], False)
            except Exception as exc:
                log.warning("tiercache: giving back the TTL of tag %r on tier %s failed: %s", tag, tier.name, exc)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop polling and wait (a bounded time) for a poll under way, before the tiers close."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
