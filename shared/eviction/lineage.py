"""A record's parent: the record of the block before it, named in its meta for prefix-aware eviction.

Why here, beside the policies: the link exists for them (`prefix`); the writer (the KV saver) and the
owner that reads it (the memory tier) both import it from here. Why in the meta: it travels with
`Store.put_many`'s items to every tier without a new argument, and `records.encode` keeps it in the
checksummed header (16 bytes), so a tier that reads records back knows it too. Only KV records have one
(the KV saver names, for each layer's record of a chunk, the same layer's record of the chunk before it);
a record without it is a root. The memory tier passes it to its policy's `insert` (`prefix` evicts leaves
first and never keeps a child whose parent is gone); other policies ignore it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The meta key a record's parent travels under: the parent record's 16-byte key digest.
PARENT_KEY = "parent"


def parent_of(meta: Mapping[str, Any] | None) -> bytes | None:
    """The parent digest a record's meta names; None without one (or with anything but bytes: a store key's
    digest)."""
    if not meta:
        return None
    parent = meta.get(PARENT_KEY)
    return parent if isinstance(parent, bytes) and parent else None
