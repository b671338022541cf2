"""How records lie in the bucket: object names under the tier's prefix, and the metadata beside a record.

Layout (``H`` is the key digest in hex, `vllm_tiercache.shared.store.api.StoreKey.hex`)::

    {prefix}r/{H}              one record, whole: the record format of `vllm_tiercache.shared.store.records`
                               (header with the key digest, version, checksums, tags in its meta; payload);
                               or a pack of a KV chunk's layer records, itself a record (`packs`).
                               User metadata: ``tc-key`` (the key text, for `tiercache stats` / `evict`),
                               ``tc-tags`` (its tags), so an admin listing reads no payload, and for a pack
                               ``tc-members`` (how many records it holds).
    {prefix}sys/control        the store's control entries (invalidations, pins): one CBOR map, changed
                               only by conditional PUT (If-Match / If-None-Match)
    {prefix}sys/janitor        the janitor's lock: created by If-None-Match, taken over when stale
    {prefix}sys/usage          the last sweep's result (bytes, entries, grants, eviction generation)
    {prefix}sys/evicted        the digests the last eviction deleted, and the generations it went from and to
    {prefix}sys/use/{writer}   one writer's usage ledger (its reads: digest -> unix time)

Why one object per record, written whole: a PUT of a whole object is atomic in S3, so the PUT is the commit;
a writer killed mid-PUT leaves nothing, and two writers of one key write the same bytes. Why the digest and
not the key text in the name: no key can become an unexpected path, names have one length, and the digest
already carries every identity field the other tiers use (model, weights, salts, rank, layer).
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from vllm_tiercache.shared.store.api import StoreKey, key_text_bytes
from vllm_tiercache.shared.store.tags import decode_tags, encode_tags

#: S3 keeps at most 2 KiB of user metadata per object (AWS); past this the key text is left out (the admin
#: commands then show the record without it, as they do a disk record whose index was rebuilt), and tags that
#: alone take more (16 tags of 128 characters) are kept in the record's header only: `evict --tag`, `stats
#: --by-tag` and the janitor's pins do not see them (a known limit; tags that short are the norm).
MAX_METADATA = 1900
KEY_FIELD, TAGS_FIELD, MEMBERS_FIELD = "tc-key", "tc-tags", "tc-members"


class ObjectNames:
    """The object names of one tier's prefix (digests only, never key text)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.records = f"{prefix}r/"
        self.control = f"{prefix}sys/control"
        self.lock = f"{prefix}sys/janitor"
        self.usage = f"{prefix}sys/usage"
        self.evicted = f"{prefix}sys/evicted"
        self.ledgers = f"{prefix}sys/use/"

    def record(self, key: StoreKey) -> str:
        return f"{self.records}{key.hex}"

    def record_of(self, hex_digest: str) -> str:
        return f"{self.records}{hex_digest}"

    def digest_of(self, name: str) -> str | None:
        """The digest (hex) in a record's name; None for any other name under the prefix."""
        if not name.startswith(self.records):
            return None
        hex_digest = name[len(self.records):]
        return hex_digest if len(hex_digest) == 32 and all(c in "0123456789abcdef" for c in hex_digest) else None

    def ledger(self, writer: str) -> str:
        return f"{self.ledgers}{writer}"


def record_metadata(key: StoreKey, tags: tuple[str, ...], members: int | None = None) -> dict[str, str]:
    """The user metadata of a record: its tags and key text, percent-encoded (S3 metadata is ASCII), and for a
    pack of records (`packs`) how many it holds (so a HEAD tells a member's share of the pack's size)."""
    meta: dict[str, str] = {} if members is None else {MEMBERS_FIELD: str(members)}
    encoded = quote(encode_tags(tags), safe="") if tags else ""
    if encoded and len(encoded) <= MAX_METADATA:  # longer: in the record's header only (admin listings miss it)
        meta[TAGS_FIELD] = encoded
    text = quote(key_text_bytes(key.text), safe="")
    if len(text) + len(meta.get(TAGS_FIELD, "")) <= MAX_METADATA:
        meta[KEY_FIELD] = text
    return meta


def members_in(metadata: dict[str, str]) -> int:
    """How many records a pack's metadata says it holds (1 for a record alone, or a count unreadable)."""
    raw = metadata.get(MEMBERS_FIELD, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def text_of(metadata: dict[str, str]) -> str:
    """The key text a record's metadata holds ("" when none)."""
    raw = metadata.get(KEY_FIELD)
    return unquote(raw, errors="replace") if raw else ""


def tags_in(metadata: dict[str, str]) -> tuple[str, ...]:
    """The tags a record's metadata holds (() when none)."""
    raw = metadata.get(TAGS_FIELD)
    return decode_tags(unquote(raw, errors="replace").encode("utf-8", "surrogatepass")) if raw else ()
