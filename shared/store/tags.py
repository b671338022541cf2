"""Tags on records: short operator strings ("doc:1234", "corpus:v3") that `tiercache evict --tag`,
`tiercache stats --by-tag` and pins select records by.

Why in the record's meta: `records.encode` already keeps the meta dict in the checksummed header, so a
record's tags survive restarts and a disk index rebuilt from the headers recovers them. A record without
tags has no ``"tags"`` key at all (it costs nothing). Each shared tier also keeps the tags beside the record
where an admin command finds them without reading a payload (disk: the index's ``tags`` database; Redis: the
record's ``#tags`` key); an older build ignores both.

Tags are validated where they enter (`validate_tags`): non-empty, printable, bounded in length and count,
so a tag never breaks the index encoding (newline-joined) or grows a header past its limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: The meta key a record's tags travel under (`Store.put_many` items, the record header).
TAGS_KEY = "tags"
#: The most characters one tag may have.
MAX_TAG_LENGTH = 128
#: The most tags one record may carry.
MAX_TAGS = 16
_ALLOWED = (f"a non-empty string of at most {MAX_TAG_LENGTH} printable characters (no control characters), "
            f"at most {MAX_TAGS} tags per record, e.g. doc:1234 or corpus:v3")


def check_tag(tag: Any) -> str:
    """``tag`` itself when valid; ValueError naming the bad tag and what is allowed otherwise."""
    if (not isinstance(tag, str) or not tag.strip() or len(tag) > MAX_TAG_LENGTH
            or any(not ch.isprintable() for ch in tag)):
        raise ValueError(f"invalid tag {tag!r}; allowed: {_ALLOWED}")
    return tag


def validate_tags(tags: Iterable[Any]) -> list[str]:
    """The tags in their first order without repeats, each checked (`check_tag`); ValueError otherwise."""
    if isinstance(tags, (str, bytes)):
        raise ValueError(f"invalid tags {tags!r}; allowed: a list of tags, each {_ALLOWED}")
    out: list[str] = []
    for tag in tags:
        if check_tag(tag) not in out:
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise ValueError(f"invalid tags: {len(out)} tags ({', '.join(out[:3])}, ...); allowed: {_ALLOWED}")
    return out


def tags_of(meta: Mapping[str, Any] | None) -> tuple[str, ...]:
    """A record's tags from its meta (empty when it has none, or what it has is not a list of strings:
    a reader never fails a record for its tags)."""
    raw = meta.get(TAGS_KEY) if meta else None
    if not isinstance(raw, list):
        return ()
    return tuple(t for t in raw if isinstance(t, str))


def with_tags(meta: Mapping[str, Any] | None, tags: Iterable[str]) -> dict[str, Any]:
    """A copy of ``meta`` whose tags are its own plus ``tags`` (validated); no ``"tags"`` key when none."""
    out = dict(meta or {})
    merged = validate_tags([*tags_of(out), *tags])
    if merged:
        out[TAGS_KEY] = merged
    else:
        out.pop(TAGS_KEY, None)
    return out


def encode_tags(tags: Iterable[str]) -> bytes:
    """Tags as the bytes a tier keeps beside a record (newline-joined UTF-8: a tag has no control character)."""
    return "\n".join(tags).encode("utf-8", "surrogatepass")


def decode_tags(raw: bytes | memoryview | None) -> tuple[str, ...]:
    """`encode_tags` read back; () for None or empty."""
    if not raw:
        return ()
    return tuple(t for t in bytes(raw).decode("utf-8", "replace").split("\n") if t)
