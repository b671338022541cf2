"""Seal and open records with AES-256-GCM: the payload encrypted, the header's identifying fields bound.

What a sealed record is, to a tier: an ordinary record (`vllm_tiercache.shared.store.records`) whose tensor
is the ciphertext (uint8, the plaintext's bytes plus the 16-byte GCM tag) and whose meta carries a
``"sealed"`` entry: the format of sealing (``v``), the key id (``kid``), the 96-bit random nonce, and the
plaintext's dtype and shape. The tiers need not know: they checksum, store, list and delete it like any
other record, so every tier that leaves the process, a future one too, gets sealing from the store
(`vllm_tiercache.shared.store.sealing.tiers`), not from its own code.

Bound as associated data (a record whose header was edited, or whose payload was moved under another key,
fails to open): the key digest the record is stored under, the sealing entry (version, key id, nonce, dtype,
shape) and the rest of the meta (tags included). The record's tags also name its key id
(``sealed-key:<id>``), so `tiercache evict --key-id` and `stats --by-tag` find a key's records without a
payload read.

Per-tenant subkeys: the record's key is HKDF-SHA256 of the ring key with the tenant's salt (vLLM's
``cache_salt``, carried by `StoreKey.tenant`) as its info, or a fixed "no salt" marker: a record sealed for
one tenant does not open under another's salt even with the whole ring.

What stays readable (docs/reliability.md): the key text and digest, the tags, the sizes, the dtype and
shape, the key id. What does not: the tensor's bytes.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import cbor2
import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import Record, StoreKey
from vllm_tiercache.shared.store.sealing.ring import KeyRing
from vllm_tiercache.shared.store.tags import TAGS_KEY, tags_of, with_tags

#: The meta entry of a sealed record.
SEAL_KEY = "sealed"
#: Sealing format: a change of what is bound or how keys are derived needs a new one.
SEAL_VERSION = 1
#: The tag naming a sealed record's key id (what `tiercache evict --key-id` selects by).
KEY_TAG_PREFIX = "sealed-key:"
NONCE_BYTES = 12
TAG_BYTES = 16
#: Derived subkeys kept (one per key id and tenant); the cache is emptied when it is full.
MAX_SUBKEYS = 4096
_AAD_LABEL = b"tiercache-sealed-record"
_INFO_SALT = b"tiercache-seal-v1\x00salt\x00"
_INFO_NO_SALT = b"tiercache-seal-v1\x00no-salt"


class SealRejected(Exception):
    """A record that does not open. ``reason``: unsealed, unknown_key, retired_key, malformed, truncated,
    bad_tag. ``damaged``: the record can never open under this ring (the tier may delete it); the others
    (another ring's key, a retired key, a plaintext record) are left in place. The message never holds a
    key or the record's bytes."""

    def __init__(self, reason: str, damaged: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.damaged = damaged


def key_tag(kid: str) -> str:
    """The tag every record sealed under ``kid`` carries."""
    return KEY_TAG_PREFIX + kid


def tenant_info(tenant: str | None) -> bytes:
    """HKDF's info for a tenant salt (None: the marker of requests without one; never equal to a salt's)."""
    if tenant is None:
        return _INFO_NO_SALT
    return _INFO_SALT + tenant.encode("utf-8", "surrogatepass")


def _aad(key: StoreKey, head: dict[str, Any], body: dict[str, Any]) -> bytes:
    return cbor2.dumps([_AAD_LABEL, key.digest, head, body], canonical=True)


def _plain_meta(body: dict[str, Any]) -> dict[str, Any]:
    """The meta a caller sees: the sealing entry and the key-id tag removed."""
    tags = [t for t in tags_of(body) if not t.startswith(KEY_TAG_PREFIX)]
    out = {k: v for k, v in body.items() if k != TAGS_KEY}
    if tags:
        out[TAGS_KEY] = tags
    return out


class Sealer:
    """Seals records under the ring's current key and opens those of any key still in the ring.

    Thread-safe: `AESGCM` objects are, and the subkey cache is guarded by a lock.
    """

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring
        self._ciphers: dict[tuple[str, str | None], tuple[bytes, AESGCM]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Sealer({self.ring!r})"

    def _subkey(self, kid: str, tenant: str | None) -> tuple[bytes, AESGCM]:
        """The tenant's subkey of ring key ``kid`` and its cipher (derived once, then cached)."""
        cached = self._ciphers.get((kid, tenant))
        if cached is not None:
            return cached
        subkey = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                      info=tenant_info(tenant)).derive(self.ring.keys[kid])
        entry = (subkey, AESGCM(subkey))
        with self._lock:
            if len(self._ciphers) >= MAX_SUBKEYS:
                self._ciphers.clear()
            self._ciphers[(kid, tenant)] = entry
        return entry

    def _cipher(self, kid: str, tenant: str | None) -> AESGCM:
        return self._subkey(kid, tenant)[1]

    def seal(self, key: StoreKey, tensor: torch.Tensor, meta: dict[str, Any] | None
             ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The ciphertext tensor and the sealed meta for ``tensor`` stored under ``key`` (for ``key.tenant``)."""
        kid = self.ring.current
        body = {k: v for k, v in (meta or {}).items() if k != SEAL_KEY}
        try:
            body = with_tags(body, [key_tag(kid)])
        except ValueError:  # already the most tags a record may carry: found by its header only
            pass
        plain = records.tensor_bytes(tensor)
        head = {"v": SEAL_VERSION, "kid": kid, "nonce": os.urandom(NONCE_BYTES),
                "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        out = np.empty(plain.nbytes + TAG_BYTES, dtype=np.uint8)
        self._cipher(kid, key.tenant).encrypt_into(head["nonce"], plain, _aad(key, head, body), out)
        return torch.from_numpy(out), {**body, SEAL_KEY: head}

    def open(self, key: StoreKey, record: Record, into: Sequence[memoryview] | None = None) -> Record:
        """The plaintext record of a sealed one read for ``key``; `SealRejected` when it does not open.

        ``into``: where the caller wants the plaintext (`Store.get_many`'s ``into``: writable byte views, one
        after the other); when they hold exactly the plaintext's bytes it is decrypted straight there (no
        buffer, no copy after) and the record is ``in_place``. A record that does not open may have written
        there: the caller takes the destination as garbage then, as for any miss."""
        head = record.meta.get(SEAL_KEY)
        if not isinstance(head, dict):
            raise SealRejected("unsealed", damaged=False)
        kid = head.get("kid")
        if not isinstance(kid, str):
            raise SealRejected("malformed", damaged=True)
        if kid in self.ring.retired:
            raise SealRejected("retired_key", damaged=False)
        if kid not in self.ring.keys:
            raise SealRejected("unknown_key", damaged=False)
        try:
            if head.get("v") != SEAL_VERSION:
                raise ValueError("sealing version")
            nonce = head["nonce"]
            dtype = records._dtype_from_name(head["dtype"])
            shape = tuple(int(s) for s in head["shape"])
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES or any(s < 0 for s in shape):
                raise ValueError("nonce or shape")
            if len(shape) > records.MAX_DIMS:
                raise ValueError("rank")
            nbytes = math.prod(shape) * dtype.itemsize
        except (KeyError, TypeError, ValueError, OverflowError, records.RecordError):
            raise SealRejected("malformed", damaged=True) from None
        ct = records.joined_copy(record) if record.in_place else record.tensor
        if ct.dtype != torch.uint8 or ct.numel() != nbytes + TAG_BYTES:
            raise SealRejected("truncated", damaged=True)
        body = {k: v for k, v in record.meta.items() if k != SEAL_KEY}
        if into is not None and nbytes and sum(piece.nbytes for piece in into) == nbytes:
            return self._open_into(key, kid, head, body, ct, into, dtype, shape)
        out = np.empty(nbytes, dtype=np.uint8)
        try:
            self._cipher(kid, key.tenant).decrypt_into(nonce, records.tensor_bytes(ct), _aad(key, head, body), out)
        except InvalidTag:
            raise SealRejected("bad_tag", damaged=True) from None
        try:
            tensor = torch.from_numpy(out).view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        except (RuntimeError, TypeError, ValueError):  # a dtype torch cannot view raw bytes as (a quantized one)
            raise SealRejected("malformed", damaged=True) from None
        return Record(tensor, _plain_meta(body))

    def _open_into(self, key: StoreKey, kid: str, head: dict[str, Any], body: dict[str, Any], ct: torch.Tensor,
                   into: Sequence[memoryview], dtype: torch.dtype, shape: tuple[int, ...]) -> Record:
        """`open` decrypting piece by piece into ``into`` (GCM's streaming form: the tag is checked last)."""
        data = records.tensor_bytes(ct)
        decryptor = Cipher(algorithms.AES(self._subkey(kid, key.tenant)[0]),
                           modes.GCM(head["nonce"], bytes(data[-TAG_BYTES:]))).decryptor()
        decryptor.authenticate_additional_data(_aad(key, head, body))
        offset = 0
        for piece in into:
            decryptor.update_into(data[offset:offset + piece.nbytes], piece)
            offset += piece.nbytes
        try:
            decryptor.finalize()
        except InvalidTag:
            raise SealRejected("bad_tag", damaged=True) from None
        return Record(torch.empty(shape, dtype=dtype, device="meta"), _plain_meta(body), in_place=True,
                      pieces=tuple(into))
