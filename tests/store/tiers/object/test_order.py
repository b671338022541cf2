"""The object tier's ``prefix`` order and usage ledgers without a server: keys, parents before children never,
the turnover half-life, and ledgers of this build and of the build before it read side by side."""

from __future__ import annotations

import math
import random

import cbor2
import pytest

from vllm_tiercache.shared.store.tiers.object.sweeps.ledger import (
    GHOST_FACTOR,
    MAX_LEDGER_ENTRIES,
    MIN_LEDGER_ENTRIES,
    MergedLedgers,
    UsageLedger,
    ledger_bound,
)
from vllm_tiercache.shared.store.tiers.object.sweeps.order import (
    NEWCOMER,
    Candidate,
    half_life_s,
    lru_order,
    next_turnover,
    prefix_order,
    sweep_turnover,
    turnover,
)


def _c(d: str, last: float, count: float = NEWCOMER, parent: str | None = None, size: int = 1) -> Candidate:
    return Candidate(d, f"r/{d}", size, last, count, parent)


def _names(ranked: list[tuple[float, str, int]]) -> list[str]:
    return [name[2:] for _, name, _ in ranked]


def test_a_record_read_again_outranks_newer_one_offs_within_its_count():
    # read 4 times at 100 (count 4.1): key 100 + 10 x log2(4.1); one-offs written later count a tenth
    ranked = prefix_order([_c("aa", 100.0, 4.1), _c("bb", 110.0), _c("cc", 130.0), _c("dd", 160.0)], 10.0)
    assert _names(ranked) == ["bb", "cc", "aa", "dd"]  # 110 - 33.2 < 130 - 33.2 < 100 + 20.4 < 160 - 33.2
    assert ranked[2][0] == pytest.approx(100.0 + 10.0 * math.log2(4.1))
    assert _names(lru_order([_c("aa", 100.0, 4.1), _c("bb", 110.0)])) == ["aa", "bb"]  # lru: last use alone


def test_a_parent_ranks_at_least_as_high_as_its_descendants_and_goes_after_them():
    # a chain whose tail was read lately (a faster tier in front served the head): lru takes the head first
    chain = [_c("a0", 10.0), _c("a1", 10.0, parent="a0"), _c("a2", 50.0, 2.0, parent="a1"),
             _c("a3", 10.0, parent="a2")]
    ranked = prefix_order([*chain, _c("zz", 60.0)], 5.0)
    # a3 (a leaf, a newcomer at 10) first, then the one-off zz (60 - 16.6), then a2 (50 + 5) with its parents
    assert _names(ranked) == ["a3", "zz", "a2", "a1", "a0"]
    keys = {name[2:]: key for key, name, _ in ranked}
    assert keys["a0"] == keys["a1"] == keys["a2"] == pytest.approx(50.0 + 5.0)  # raised to a2's
    assert _names(lru_order(chain))[0] == "a0"  # lru: the head goes first, its read child stays


def test_a_chain_written_in_one_batch_goes_tail_first_whatever_its_digests():
    chain = [_c(f"{9 - i:02x}", 7.0, parent=f"{10 - i:02x}" if i else None) for i in range(10)]
    assert _names(prefix_order(chain, 1.0)) == [c.digest for c in reversed(chain)]


@pytest.mark.parametrize("seed", range(5))
def test_no_record_comes_before_a_listed_descendant(seed):
    rng = random.Random(seed)
    cands: list[Candidate] = []
    for i in range(400):
        parent = cands[rng.randrange(len(cands))].digest if cands and rng.random() < 0.8 else None
        cands.append(_c(f"{i:04x}", rng.uniform(0, 1000), rng.choice([NEWCOMER, 1.0, 3.5, 20.0]), parent,
                        rng.randint(1, 9)))
    rng.shuffle(cands)
    position = {name: i for i, name in enumerate(_names(prefix_order(cands, rng.uniform(1, 300))))}
    for c in cands:
        if c.parent is not None:
            assert position[c.digest] < position[c.parent]


def test_an_unlisted_parent_a_self_parent_and_a_cycle_are_roots_and_end():
    cands = [_c("aa", 1.0, parent="gone"), _c("bb", 2.0, parent="bb"), _c("cc", 3.0, parent="dd"),
             _c("dd", 4.0, parent="cc")]
    assert sorted(_names(prefix_order(cands, 1.0))) == ["aa", "bb", "cc", "dd"]


def test_the_turnover_is_the_time_one_capacity_of_writes_takes_averaged_over_about_one_capacity():
    assert next_turnover(None, 0, 5.0, 100) is None  # nothing written since: nothing measured
    assert next_turnover(None, 10, 5.0, 100) == pytest.approx(50.0)  # 10 bytes in 5 s: 100 in 50 s
    assert next_turnover(50.0, 10, 10.0, 100) == pytest.approx(50.0 + 0.1 * (100.0 - 50.0))  # 10% of capacity
    assert next_turnover(50.0, 10, -1.0, 100) == 50.0  # a clock that went back: kept
    # two sweeps at one instant: the writes between them count, as a microsecond apart (not dropped)
    assert next_turnover(50.0, 10, 0.0, 100) == pytest.approx(45.0)
    assert next_turnover(50.0, 10, 0.0, 100) == pytest.approx(next_turnover(50.0, 10, 1e-9, 100))
    assert next_turnover(None, 10, 0.0, 100) is None  # nothing to start from
    # one capacity written in 100 s, in ten sweeps, every other one at the same instant as the one before:
    # the average stays at the pace (dropping the instant ones made it 200 s)
    pace = 100.0
    for k in range(200):
        pace = next_turnover(pace, 10, 20.0 if k % 2 else 0.0, 100)
    assert pace == pytest.approx(100.0, rel=0.1)
    # from sys/usage as the previous sweep left it: 900 bytes then, 1,000 now, 5 s later
    previous = {"bytes": 900, "listed_at": 1000.0, "turnover_s": 30.0, "generation": "g"}
    assert sweep_turnover(previous, 1000, 1005.0, 1000, []) == pytest.approx(30.0 + 0.1 * (50.0 - 30.0))
    # no previous sweep (or an older build's usage): twice the median age of what is listed
    steady = [_c(f"{t:04x}", float(t)) for t in range(1000, 1101)]  # one record a second for 100 s
    assert sweep_turnover({"bytes": 5}, 1000, 1005.0, 1000, steady) == pytest.approx(100.0)
    assert turnover([*[c.last for c in steady], 0.0], [1] * 102) == pytest.approx(100.0)  # not 1100
    assert half_life_s(0.0, 2.0) > 0 and half_life_s(40.0, 0.5) == 20.0


def test_a_stale_majority_read_once_ages_out_when_the_turnover_is_the_write_pace():
    """A tier whose records were read once, then a workload of one-offs only, one a second: with the
    half-life from the pace of writes (10 records a turnover) the old records go once they are older than
    (log2(1.1) + log2(10)) half-lives; by the ages of what is held they never would (it grows with them)."""
    stale = [_c(f"s{i:03x}", 0.0, 1.1) for i in range(6)]
    fresh = [_c(f"f{i:03x}", 100.0 + i) for i in range(4)]
    by_pace = prefix_order([*stale, *fresh], half_life_s(10.0, 1.0))
    assert {name[2:] for _, name, _ in by_pace[:6]} == {c.digest for c in stale}
    by_ages = prefix_order([*stale, *fresh], half_life_s(turnover([c.last for c in stale + fresh], [1] * 10), 1.0))
    assert {name[2:] for _, name, _ in by_ages[:4]} == {c.digest for c in fresh}  # why not the ages


def test_the_ledger_counts_newcomers_reads_and_returns_and_decays_by_the_learned_half_life():
    ledger = UsageLedger()
    ledger.wrote([("aa", None), ("bb", "aa")], 100.0)
    assert ledger.counts == {"aa": NEWCOMER, "bb": NEWCOMER} and ledger.parents == {"bb": "aa"}
    ledger.read(["aa"], 100.0)
    ledger.wrote([("aa", None)], 100.0)  # written again (evicted meanwhile): one access, not a newcomer
    assert ledger.counts["aa"] == pytest.approx(2.0 + NEWCOMER)
    ledger.half_life_s = 10.0
    ledger.read(["aa"], 120.0)  # two half-lives later: a quarter of 2.1, plus this read
    assert ledger.counts["aa"] == pytest.approx(2.1 / 4 + 1.0) and ledger.uses["aa"] == 120.0
    ledger.trim(110.0 + 7 * 86400.0)  # bb's last use (100) is past the window: it goes, with its parent
    assert set(ledger.uses) == set(ledger.counts) == {"aa"} and ledger.parents == {}


def test_a_ledger_keeps_a_few_times_what_the_last_sweep_left_the_most_recent_and_remembers_their_returns():
    held = MIN_LEDGER_ENTRIES  # a sweep left this many records: the bound is above the floor
    bound = ledger_bound(held)
    assert bound == GHOST_FACTOR * held and ledger_bound(None) == MAX_LEDGER_ENTRIES
    assert ledger_bound(0) == MIN_LEDGER_ENTRIES and ledger_bound(10**9) == MAX_LEDGER_ENTRIES
    ledger = UsageLedger()
    touched = 2 * bound  # a writer touched twice the bound's records, one at a time, each after the one before
    for i in range(touched):
        ledger.wrote([(f"{i:032x}", f"{i - 1:032x}" if i else None)], 1.0 + i)
    ledger.trim(touched + 1.0)  # no sweep known yet: nothing goes but what passes the week or the cap
    assert len(ledger.uses) == touched
    ledger.learn(held, touched + 1.0)  # a sweep listed after every one of those uses, and left `held`
    ledger.trim(touched + 2.0)
    newest = {f"{i:032x}" for i in range(touched - bound, touched)}
    assert set(ledger.uses) == set(ledger.counts) == set(ledger.parents) == newest
    assert len(cbor2.loads(ledger.encode({}))["reads"]) == bound  # the object rewritten at every sweep
    ghost, forgotten = f"{touched - bound:032x}", f"{touched - bound - 1:032x}"
    ledger.wrote([(ghost, None), (forgotten, None)], touched + 3.0)  # both evicted, written again
    assert ledger.counts[ghost] == pytest.approx(NEWCOMER + 1.0)  # a return: the ledger still held it
    assert ledger.counts[forgotten] == NEWCOMER  # beyond the bound: a newcomer again
    for i in range(bound):  # uses since the last sweep listed are kept, however many
        ledger.read([f"{touched + i:032x}"], touched + 4.0 + i)
    ledger.trim(touched + 4.0 + bound)
    assert len(ledger.uses) == bound + 2 and ghost in ledger.uses and newest & set(ledger.uses) == {ghost}


def test_ledgers_of_this_build_and_the_one_before_merge():
    a, b = bytes(range(16)), bytes(range(1, 17))
    new = UsageLedger()
    new.wrote([(b.hex(), a.hex())], 200.0)
    new.read([b.hex(), b.hex()], 210.0)
    body = cbor2.loads(new.encode({"writer": "w-new", "writing_at": 200.0, "largest": 5}))
    assert body["reads"] == {b: 210.0} and body["parents"] == {b: a}  # what an older build reads: "reads"
    old = {"writer": "w-old", "writing_at": 150.0, "largest": 5, "reads": {a: 150.0, b: 220.0}}  # no counts
    merged = MergedLedgers()
    merged.add(body)
    merged.add(old)
    assert merged.reads == {a.hex(): 150.0, b.hex(): 220.0}
    assert merged.counts == {a.hex(): 1.0, b.hex(): pytest.approx(2.1 + 1.0)}  # the older build's: 1 each
    assert merged.parents == {b.hex(): a.hex()}
    assert merged.candidate(a.hex(), "r/a", 9, 100.0) == Candidate(a.hex(), "r/a", 9, 150.0, 1.0, None)
    unknown = merged.candidate("ff" * 16, "r/f", 9, 100.0)  # no ledger holds it: its write alone
    assert unknown.count == NEWCOMER and unknown.last == 101.0


def test_a_damaged_count_counts_one_and_a_damaged_ledger_adds_nothing():
    a = bytes(16)
    merged = MergedLedgers()
    merged.add({"reads": {a: 5.0}, "counts": {a: "lots"}, "parents": {a: 7}})
    assert merged.counts == {a.hex(): 1.0} and merged.parents == {}
    with pytest.raises(AttributeError):
        merged.add({"reads": {"not-bytes": 6.0, a: 9.0}})
    assert merged.reads == {a.hex(): 5.0}  # nothing of the damaged ledger was merged
