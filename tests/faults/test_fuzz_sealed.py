"""Fuzzing sealed records: whatever a shared tier hands back where a sealed record should be, opening it is
a `SealRejected` (a counted miss) or, only for the untouched record, the tensor that was sealed.

Why: the sealing entry and the meta come from a tier anyone with write access to Redis or the disk can
edit; a forged entry must never raise anything else (the store would take a whole batch as a tier error).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_tiercache.shared.store.api import Record, StoreKey
from vllm_tiercache.shared.store.sealing.ring import KeyRing
from vllm_tiercache.shared.store.sealing.sealer import SEAL_KEY, Sealer, SealRejected

FUZZ = settings(derandomize=True, max_examples=300, deadline=datetime.timedelta(seconds=5),
                suppress_health_check=[HealthCheck.too_slow])
SEALER = Sealer(KeyRing("k1", {"k1": os.urandom(32)}, frozenset({"old"})))
KEY = StoreKey("kv|fuzz", tenant="A")
TENSOR = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
CIPHERTEXT, META = SEALER.seal(KEY, TENSOR, {"tags": ["doc:1"]})

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=12), st.binary(max_size=16))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                       max_leaves=8)
_fields = st.sampled_from(["v", "kid", "nonce", "dtype", "shape", "extra"])
_dtypes = st.sampled_from(["float32", "bfloat16", "int8", "qint8", "bool", "complex64", "float8_e4m3fn", "nope"])


def _open(meta: dict[str, Any], ciphertext: torch.Tensor = CIPHERTEXT) -> Record | None:
    try:
        return SEALER.open(KEY, Record(ciphertext, meta))
    except SealRejected:
        return None


@FUZZ
@given(st.dictionaries(_fields, _values, max_size=6), st.one_of(st.none(), _values))
def test_any_sealing_entry_is_a_rejection(entry: dict[str, Any], tags: Any) -> None:
    meta: dict[str, Any] = {SEAL_KEY: entry}
    if tags is not None:
        meta["tags"] = tags
    assert _open(meta) is None


@FUZZ
@given(_fields, st.one_of(_values, _dtypes, st.lists(st.integers(-3, 2**40), max_size=70)), st.data())
def test_one_field_of_a_real_entry_changed_is_a_rejection(field: str, value: Any, data: st.DataObject) -> None:
    head = dict(META[SEAL_KEY])
    if value == head.get(field):
        return
    head[field] = value
    cut = data.draw(st.integers(0, CIPHERTEXT.numel()))
    assert _open({**META, SEAL_KEY: head}, CIPHERTEXT[:cut].clone()) is None
    assert _open({**META, SEAL_KEY: head}) is None


def test_the_untouched_record_opens() -> None:
    opened = _open(dict(META))
    assert opened is not None and torch.equal(opened.tensor, TENSOR) and opened.meta == {"tags": ["doc:1"]}
