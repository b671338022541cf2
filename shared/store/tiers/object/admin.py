"""The object tier's admin side: `tiercache stats` / `tiercache evict` listings and deletes, and the store's
control entries (invalidations by tag, pins) in one object changed only by conditional PUT.

Unlike the serving calls, these raise `ConnectionError` when the endpoint, the bucket or the credentials
fail (an admin command must say so, not report an empty store); the message names the endpoint and bucket
and the S3 error code, never a credential. A listing is one LIST per 1,000 records plus a HEAD per record
(for its key text and tags, kept in the record's metadata: no payload is read), many in flight.

Why the control entries use If-Match: every process and host changes them (`tiercache pin`, `evict --tag`),
and a plain read-modify-write would lose one writer's change; a conditional PUT loses nothing, and
`remove_control` is true for exactly one caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import cbor2

from vllm_tiercache.shared.store.api import StoredRecord
from vllm_tiercache.shared.store.tiers.object.calls import ObjectCalls
from vllm_tiercache.shared.store.tiers.object.client import CONFLICT, MISSING, classify, error_code
from vllm_tiercache.shared.store.tiers.object.names import ObjectNames, tags_in, text_of

#: Tries of one control change against other writers' changes (each loses only to a change that landed).
CONTROL_TRIES = 50
#: Records listed, then HEADed, per round.
ADMIN_BATCH = 256


class ObjectAdmin:
    """`iter_stored`, `delete_stored` and the control entries of one object tier."""

    def __init__(self, names: ObjectNames, calls: ObjectCalls, address: str,
                 ledger_reads: Callable[[], dict[str, float]]) -> None:
        self.names = names
        self.calls = calls
        self.address = address
        self._ledger_reads = ledger_reads

    def unreachable(self, what: str, exc: BaseException) -> ConnectionError:
        """The one error of the admin side: endpoint, bucket, what failed and the S3 code (no secret)."""
        code = error_code(exc)
        return ConnectionError(f"object tier {self.address}: {what} failed ({type(exc).__name__}"
                               f"{' ' + code if code else ''}); check the endpoint, the bucket and the AWS "
                               "credentials of this process")

    # ------------------------------------------------------------------------------------- listings
    def scan(self) -> Iterator[tuple[str, StoredRecord]]:
        """(object name, `StoredRecord`) of every record under the prefix; ConnectionError when it fails."""
        try:
            reads = self._ledger_reads()
            batch: list[dict[str, Any]] = []
            for obj in self.calls.list_names(self.names.records):
                if self.names.digest_of(obj["Key"]) is None:
                    continue
                batch.append(obj)
                if len(batch) >= ADMIN_BATCH:
                    yield from self._described(batch, reads)
                    batch = []
            if batch:
                yield from self._described(batch, reads)
        except ConnectionError:
            raise
        except Exception as exc:
            raise self.unreachable("listing the records", exc) from None

    def _described(self, batch: list[dict[str, Any]], reads: dict[str, float]) -> Iterator[tuple[str, StoredRecord]]:
        def head(obj: dict[str, Any]) -> dict[str, Any] | None:
            try:
                return self.calls.head(obj["Key"])
            except Exception as exc:
                if classify(exc) == MISSING:  # deleted between the listing and the HEAD
                    return None
                raise

        now = time.time()
        for obj, meta in zip(batch, self.calls.map_raw(head, batch), strict=True):
            if meta is None:
                continue
            used = max(obj["LastModified"].timestamp(), reads.get(self.names.digest_of(obj["Key"]) or "", 0.0))
            # (idle time: the newest of the write and the reads; the janitor's order breaks ties finer)
            metadata = meta.get("Metadata") or {}
            yield obj["Key"], StoredRecord(text_of(metadata), int(obj["Size"]), max(0.0, now - used),
                                           tags_in(metadata))

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *, dry_run: bool = False) -> tuple[int, int]:
        """Delete the records ``predicate`` accepts; (records, bytes), or what would be with ``dry_run``."""
        matches = [(name, rec.nbytes or 0) for name, rec in self.scan() if predicate(rec)]
        if dry_run or not matches:
            return len(matches), sum(size for _, size in matches)

        def delete(name: str) -> None:
            try:
                self.calls.delete(name)
            except Exception as exc:
                if classify(exc) != MISSING:
                    raise

        try:
            self.calls.map_raw(delete, [name for name, _ in matches])
        except Exception as exc:
            raise self.unreachable("deleting records", exc) from None
        return len(matches), sum(size for _, size in matches)

    # ------------------------------------------------------------------------------ control entries
    def _read(self) -> tuple[dict[str, bytes], str | None]:
        """The control entries and the ETag they were read at (None: no control object yet)."""
        try:
            got = self.calls.client.get_object(Bucket=self.calls.bucket, Key=self.names.control)
            body = got["Body"].read()
        except Exception as exc:
            if classify(exc) == MISSING:
                return {}, None
            raise self.unreachable("reading the control entries", exc) from None
        try:
            entries = cbor2.loads(body)
            if not isinstance(entries, dict):
                raise ValueError("not a map")
        except Exception:  # damaged: start from empty (the next write replaces it)
            entries = {}
        return {str(k): bytes(v) for k, v in entries.items() if isinstance(v, (bytes, bytearray))}, got["ETag"]

    def read_control(self) -> dict[str, bytes]:
        return self._read()[0]

    def _change(self, edit: Callable[[dict[str, bytes]], bool]) -> bool:
        """Apply ``edit`` (which returns whether it changed anything) by conditional PUT, again after a
        conflict; returns what the landed ``edit`` returned."""
        for _ in range(CONTROL_TRIES):
            entries, etag = self._read()
            if not edit(entries):
                return False
            condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
            try:
                self.calls.put(self.names.control, cbor2.dumps(entries), **condition)
                return True
            except Exception as exc:
                if classify(exc) not in (CONFLICT, MISSING):
                    raise self.unreachable("writing the control entries", exc) from None
        raise ConnectionError(f"object tier {self.address}: the control entries changed under {CONTROL_TRIES} "
                              "tries in a row; try again")

    def write_control(self, changes: Mapping[str, bytes | None]) -> None:
        def edit(entries: dict[str, bytes]) -> bool:
            for name, value in changes.items():
                if value is None:
                    entries.pop(name, None)
                else:
                    entries[name] = bytes(value)
            return True

        self._change(edit)

    def remove_control(self, name: str) -> bool:
        return self._change(lambda entries: entries.pop(name, None) is not None)
