"""Weights generations: how an engine stops using records after its weights changed in place.

Why: vLLM 0.32 can change a running engine's weights without a restart (RL training loops:
``reload_weights`` / weight-sync RPCs between ``pause_generation(clear_cache=True)`` and resume, sleep
mode). It then resets its caches: ``Scheduler.reset_prefix_cache(reset_connector=True)`` calls the KV
connector's ``reset_cache``, ``Scheduler.reset_encoder_cache`` drops its encoder outputs. Our records are
named by the weights' digest *on disk* (`vllm_tiercache.shared.naming.weights_identity`), which an in-place
update does not change, so without more the connectors would keep serving KV and encoder outputs computed
with the old weights: silently wrong outputs.

Deleting the records is not the answer: they are shared (disk, Redis) and right for every other replica
still running the original weights. So a reset starts a new *generation* in this engine instead: a
fresh random salt mixed into every name the engine looks up or saves from then on. Records of earlier
generations are never read again by this engine (their names are unreachable), other engines keep
using them, and what this engine saves afterwards is private to its generation: no other process
knows the salt, so it cannot read them (to share records computed with the new weights, restart the
engines with the new weights on disk; the weights digest names them). `tiercache evict` reclaims them.

The salt is random rather than a counter so that two engines both reset once (same model, different
updates) never meet each other's records. The mixing is a keyed blake2b with its own ``person``: for an
encoder output here (`generation_mm_name`), for a KV chunk where every chunk name is made
(`vllm_tiercache.kvcache.naming.generation_chunk_hash`, beside the LoRA adapter's salt).
"""

from __future__ import annotations

import hashlib
import os

_PERSON = b"tiercache-gen"
#: bytes of randomness per generation (128 bits: two engines never draw the same salt)
SALT_BYTES = 16


def new_salt() -> bytes:
    """A fresh generation salt."""
    return os.urandom(SALT_BYTES)


def generation_mm_name(mm_hash: str, salt: bytes | None) -> str:
    """An encoder output's name in generation `salt`: the multimodal identifier itself before any reset,
    else ``gen:`` and a digest of the identifier and the salt (any identifier, even a user's uuid, maps
    to a name no process without the salt can produce)."""
    if salt is None:
        return mm_hash
    digest = hashlib.blake2b(mm_hash.encode("utf-8", "surrogatepass") + b"|" + salt, digest_size=32,
                             person=_PERSON).hexdigest()
    return f"gen:{digest}"


class Generation:
    """An engine's current weights generation: no salt until the first reset, a new one at each reset."""

    def __init__(self) -> None:
        self.salt: bytes | None = None
        #: resets since the engine started
        self.resets = 0

    def advance(self) -> bytes:
        """Start a new generation; returns its salt."""
        self.salt = new_salt()
        self.resets += 1
        return self.salt
