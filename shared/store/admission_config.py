"""The ``admission`` section of a slower tier (disk, GDS, Redis): which records a put writes down to it.

Why a section of the tier and not of the store: each slower tier costs something else per byte written (a
local disk's writes, a Redis server's memory and network shared by every machine), so each says how sure
the store must be that a record will be used again before it writes it there. The fastest tier (memory)
always takes a put; the runtime rule is `vllm_tiercache.shared.store.admission`.

Why beside `tier_config` and not in it: it is one small section that two tier configs embed; reading a
config must not import torch, and this module imports only the config helpers.

Policies: ``always`` (every put is written through: the default, which keeps the product's promise that a
record survives a restart and is seen by the other machines at once) and ``seen`` (a record is written
down once it has been asked for ``min_seen`` times, counting the put that stored it, in the frequency
sketch W-TinyLFU uses, `vllm_tiercache.shared.eviction.sketch.FrequencySketch`, which forgets counts
after ``window_records`` accesses; or, with ``reused_prompt_share``, at once when the put comes from a
request whose prompt was mostly reused: a conversation's next turn and a question on a cached document
extend a prefix that is being asked again, and their new chunks are the next turn's prefix). Measured:
docs/benchmarks.md, "Admission to the slower tiers". ``evicted`` makes the tier exclusive of the memory
tier (a put is not written through; what the memory tier evicts is written down, and a clean close writes
down the rest): memory and that tier then hold different records, so together they hold their sum, not
about the slower one's alone (docs/benchmarks-kv.md, issue 56); the price is durability, below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal, get_args

from pydantic import ConfigDict, Field, Strict

from vllm_tiercache.shared.store.tier_config import Allowed, ConfigError, did_you_mean, invalid, validate

AdmissionPolicy = Literal["always", "seen", "evicted"]
ADMISSION_POLICIES: tuple[str, ...] = get_args(AdmissionPolicy)
#: The sketch's counters have 4 bits: a count never exceeds 15, so neither may the threshold.
MAX_MIN_SEEN = 15
MIN_WINDOW, MAX_WINDOW = 64, 1 << 24
DEFAULT_WINDOW = 1 << 16
#: Chosen with `tiercache bench admission` (docs/benchmarks.md): a turn or a question on a cached document
#: reuses most of its prompt, a one-off prompt under a shared system prompt little of it; 0.25 to 0.75 gave
#: the same hits and bytes on bench serve's trace.
DEFAULT_REUSED_PROMPT_SHARE = 0.5
_SECTION_ALLOWED = 'a mapping such as {"policy": "seen", "min_seen": 2}'


@dataclass(frozen=True)
class AdmissionConfig:
    """Which records a put writes down to this tier (`vllm_tiercache.shared.store.admission`)."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    policy: Annotated[AdmissionPolicy, Field(description=(
        "always: every put is written to this tier too (write-through; what a restart or another machine "
        "relies on). seen: a record reaches this tier once it was asked for min_seen times in this process "
        "(the put that stored it counts, then each hit): until then it lives in the memory tier only, and "
        "the hit that admits it writes the memory copy down in the background. evicted (exclusive of the "
        "memory tier): a put is not written to this tier; a record reaches it when the memory tier evicts it "
        "(or refuses it on arrival), through the background writer, and a clean close writes down what "
        "memory still holds. Memory and this tier then hold different records, so the pair holds their sum "
        "(write-through holds about this tier alone: memory keeps copies of it). The trade: a record lives "
        "in this process's memory only until it is evicted, so a crash (not a clean close) loses it, and "
        "other processes and machines do not see it there. Records a precompute job, a "
        "pin or a prefill/decode hand-off writes are always admitted (written through).")),
        Allowed(", ".join(ADMISSION_POLICIES))] = "always"
    min_seen: Annotated[int, Strict(), Field(ge=2, le=MAX_MIN_SEEN, description=(
        "seen: how many accesses (the storing put, then hits) admit a record; counted in a 4-bit frequency "
        "sketch, hence at most 15.")),
        Allowed(f"an int from 2 to {MAX_MIN_SEEN}")] = 2
    window_records: Annotated[int, Strict(), Field(ge=MIN_WINDOW, le=MAX_WINDOW, description=(
        "seen: accesses after which the counts are halved (the sketch's aging): a record asked again "
        "within about this many record accesses is still counted; the sketch costs 64 to 128 bytes "
        "per record of the window.")),
        Allowed(f"an int from {MIN_WINDOW} to {MAX_WINDOW}")] = DEFAULT_WINDOW
    reused_prompt_share: Annotated[float | None, Field(gt=0.0, le=1.0, description=(
        "seen: a put from a request whose prompt was at least this share reused (vLLM's prefix cache and "
        "this store's hits, at the request's first step) is admitted at once, without waiting for "
        "min_seen: it extends a prefix that is being asked again (a conversation's next turn, a question "
        "on a cached document), so its new chunks are likely the next request's prefix. A fresh prompt "
        "(nothing reused) still waits for min_seen; so does a one-off prompt under a shared system prompt "
        "shorter than this share of it. null: off. Puts that carry no request (encoder "
        "outputs) never use it.")),
        Allowed("a number above 0 and at most 1, or null")] = DEFAULT_REUSED_PROMPT_SHARE

    @property
    def always(self) -> bool:
        return self.policy == "always"

    @property
    def evicted(self) -> bool:
        """Exclusive of the memory tier: written down on memory's evictions, not on puts."""
        return self.policy == "evicted"


#: The section's keys, in declaration order (what an unknown key's message lists).
ADMISSION_KEYS: tuple[str, ...] = tuple(f.name for f in fields(AdmissionConfig))


def check_admission(raw: Mapping[str, Any], path: str) -> None:
    """Check a tier item's ``admission`` (if any) with messages that name ``<path>.admission.<key>``.

    Called by a tier config's ``from_raw`` before it validates the whole item: pydantic's error for a nested
    section would name the section, not the key inside it."""
    if "admission" not in raw:
        return
    section, where = raw["admission"], f"{path}.admission"
    if not isinstance(section, Mapping):
        raise invalid(where, section, _SECTION_ALLOWED)
    for name in section:
        if name not in ADMISSION_KEYS:
            raise ConfigError(f"{where}.{name}: unknown key of admission; {did_you_mean(name, ADMISSION_KEYS)}"
                              f"known keys: {', '.join(ADMISSION_KEYS)}")
    validate(AdmissionConfig, section, where)


#: The default section: every put is written through.
WRITE_THROUGH = AdmissionConfig()
