"""`tiercache bench trace` end to end on generated traces (never the published one), and its parts: the
Mooncake reader's errors, the generator's prefix rule, the GPU pool in front, the optimum as a bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.test_cli_errors import tiercache_here
from vllm_tiercache.tools.bench.trace.command import parse_tokens
from vllm_tiercache.tools.bench.trace.generate import generate_trace
from vllm_tiercache.tools.bench.trace.mooncake import TraceRequest, read_trace, write_trace
from vllm_tiercache.tools.bench.trace.optimum import belady_hits
from vllm_tiercache.tools.bench.trace.replay import Asked, plain_lru_hits, store_traffic
from vllm_tiercache.tools.cli import UsageError

REPO = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "trace", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def _refused(*args: str) -> subprocess.CompletedProcess[str]:
    """`bench trace` refusing its arguments, run in this process: a refusal needs no interpreter of its own
    (the runs above do, each a fresh one as an operator's)."""
    return tiercache_here("bench", "trace", *args)


def test_a_generated_trace_through_every_policy_prefix_at_least_lru_and_the_optimum_above_all(tmp_path) -> None:
    trace = tmp_path / "gen.jsonl"
    proc = _cli(str(trace), "--generate", "800", "--capacities", "8k,30k,100k", "--cost-puts", "2000", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["requests"] == 800 and len(read_trace(trace)) == 800
    assert [row["capacity_tokens"] for row in result["rows"]] == [8000, 30000, 100000]
    for row in result["rows"]:
        rates = row["policies"]
        assert set(rates) == {"lru", "wtinylfu", "prefix"}
        assert rates["lru"] == pytest.approx(row["lru_reference"])  # the real tier's LRU is the plain one
        assert rates["prefix"] >= row["lru_reference"], row
        assert all(row["optimum"] >= rate for rate in rates.values()), row
    assert [c["policy"] for c in result["costs"]] == ["lru", "wtinylfu", "prefix"]


def test_the_table_the_plot_and_a_request_limit(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate_trace(300, seed=2))
    plot = tmp_path / "hit.png"
    proc = _cli(str(trace), "--requests", "150", "--capacities", "10k,40k", "--policies", "lru", "prefix",
                "--cost-puts", "0", "--plot", str(plot), "--gpu-blocks", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "150 requests" in proc.stdout and "vLLM prefix cache 16 blocks" in proc.stdout
    assert "Prefix (prefix)" in proc.stdout and "optimum" in proc.stdout and "W-TinyLFU" not in proc.stdout
    assert plot.stat().st_size > 0


def test_the_object_tiers_sweeps_each_policy_and_prefix_above_lru(tmp_path) -> None:
    trace = tmp_path / "gen.jsonl"
    # 200 requests: the sweeps' simulation is deterministic, and its margins are no smaller than at 400 for half
    # the time (lru 0.009 and 0.081 against a plain LRU's 0.008 and 0.077, prefix 0.045 and 0.149)
    write_trace(trace, generate_trace(200, seed=3))
    proc = _cli(str(trace), "--capacities", "8k,30k", "--policies", "lru", "--cost-puts", "0", "--object", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    for row in rows:
        cells = row["object"]
        assert set(cells) == {"lru", "prefix"} and all(c["sweeps"] > 0 for c in cells.values())
        # sweeps evict down to below capacity: lru finds no more than a plain LRU of the whole capacity
        assert cells["lru"]["ratio"] <= row["lru_reference"] + 0.01 and cells["prefix"]["ratio"] <= row["optimum"]
        assert cells["prefix"]["ratio"] > cells["lru"]["ratio"], row
    # the text report's labels, on the trace's first requests (the figures are the JSON run's)
    table = _cli(str(trace), "--requests", "60", "--capacities", "8k", "--policies", "lru", "--cost-puts", "0",
                 "--object")
    assert table.returncode == 0, table.stderr[-3000:]
    assert "object lru (sweeps)" in table.stdout and "object prefix (sweeps)" in table.stdout


@pytest.mark.s3
def test_the_object_tier_through_a_real_bucket_keeps_what_the_simulation_keeps(tmp_path, s3_bucket) -> None:
    """A real object tier on SeaweedFS, its janitor's real sweeps (ledger, grants, listing, deletes) on the
    trace's clock, lru and prefix: each hit ratio near the simulated sweeps' on the same tiny trace, and prefix
    ahead of lru (at sweep_share 0.2 the simulation finds lru 0.148, prefix 0.194: chains read again outlive
    one-offs), each within 0.01 (ties in last use, which the simulation breaks by name within a request).
    Sweeps run between requests, never while the replay's PUTs land (`Janitor.wakes_on_writes`): a sweep
    the janitor's thread started mid-request listed records before its ledger had them, and a loaded run's
    ratios moved by up to 0.024 (with it: lru 0.1462, prefix 0.1940 in every run, loaded or not)."""
    trace = tmp_path / "gen.jsonl"
    write_trace(trace, generate_trace(60, seed=1))
    proc = _cli(str(trace), "--capacities", "102400", "--policies", "lru", "--cost-puts", "0", "--object-bucket",
                "--sweep-share", "0.2", "--s3-endpoint", s3_bucket.server.endpoint, "--s3-bucket", s3_bucket.bucket,
                "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["sweep_share"] == 0.2 and result["object_bucket_at"] == s3_bucket.server.endpoint
    (row,) = result["rows"]
    real, simulated = row["object_bucket"], row["object"]
    for policy in ("lru", "prefix"):
        cell = real[policy]
        assert cell["ratio"] == pytest.approx(simulated[policy]["ratio"], abs=0.01), (policy, real, simulated)
        assert cell["sweeps"] > 0 and cell["evicted"] > 0 and cell["held"] <= row["capacity_blocks"]
        assert cell["lost"] == 0 and cell["dropped"] == 0, cell  # settled sweeps: no lookup races a delete
    assert real["prefix"]["ratio"] > real["lru"]["ratio"] + 0.02, real
    client = s3_bucket.server.client()
    assert client.list_objects_v2(Bucket=s3_bucket.bucket).get("KeyCount", 0) == 0  # each replay cleaned up


@pytest.mark.parametrize(("flags", "message"), [
    (["--s3-endpoint", "http://127.0.0.1:1"], "only with --object-bucket"),
    (["--object-bucket", "--s3-endpoint", "http://127.0.0.1:1"], "needs --s3-bucket"),
    (["--object", "--sweep-share", "0.7"], "--sweep-share"),
])
def test_object_bucket_flags_are_one_line_errors(tmp_path, flags, message) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate_trace(5, seed=1))
    proc = _refused(str(trace), "--cost-puts", "0", *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read the trace"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\nnot json\n', ":2: not a Mooncake"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n', "missing hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}\n', "not a list of integers"),
    ("\n", "no requests"),
])
def test_bad_traces_are_one_line_errors(tmp_path, content, message) -> None:
    trace = tmp_path / "bad.jsonl"
    if content is not None:
        trace.write_text(content)
    proc = _refused(str(trace), "--cost-puts", "0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("tiercache: error: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("capacity", ["lots", "100", "-1M", "nan", ","])
def test_a_bad_capacity_is_a_one_line_error(tmp_path, capacity) -> None:
    proc = _refused(str(tmp_path / "x.jsonl"), "--capacities", capacity)
    assert proc.returncode == 2 and "--capacities" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_token_counts() -> None:
    assert [parse_tokens(t) for t in ("512", "300k", "0.3M", "10M", "1G")] == [
        512, 300_000, 300_000, 10_000_000, 1_000_000_000]


def test_generated_ids_follow_the_prefix_rule(tmp_path) -> None:
    """Equal ids exactly where prefixes are equal: an id always comes after the same id."""
    requests = generate_trace(400, seed=5)
    before: dict[int, int | None] = {}
    for request in requests:
        for i, block in enumerate(request.hash_ids):
            parent = request.hash_ids[i - 1] if i else None
            assert before.setdefault(block, parent) == parent
    assert len(before) < sum(len(r.hash_ids) for r in requests)  # prefixes are shared
    path = tmp_path / "rt.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests and read_trace(path, limit=7) == requests[:7]


def test_missing_file_raises_usage_error(tmp_path) -> None:
    with pytest.raises(UsageError, match="cannot read the trace"):
        read_trace(tmp_path / "none.jsonl")


def test_the_gpu_pool_takes_its_hits_off_the_store() -> None:
    shared = (1, 2, 3, 4)
    requests = [TraceRequest(i * 10_000.0, 2048, 1, (*shared, 100 + i)) for i in range(5)]
    alone = store_traffic(requests, 0)
    fronted = store_traffic(requests, 64)
    assert [len(a.blocks) for a in alone] == [5] * 5
    assert [len(a.blocks) for a in fronted] == [5, 1, 1, 1, 1]  # the system prompt stays in vLLM's cache
    assert fronted[1].parent == 4  # the store's first block names the block before it
    tiny = store_traffic(requests, 2)  # too small for a whole prompt: no hit, nothing breaks
    assert sum(len(a.blocks) for a in tiny) >= sum(len(a.blocks) for a in fronted)


def test_the_optimum_bounds_lru_and_bypasses_one_offs() -> None:
    asked = [(1, 2), (3,), (4,), (1, 2), (5,), (1, 2)]
    assert belady_hits(asked, 2) == 4  # keeps 1, 2 through the one-offs (bypassed)
    assert plain_lru_hits([Asked(x, None) for x in asked], 2) == 0  # LRU lets each one-off push the prefix out
    assert belady_hits(asked, 0) == 0



def test_reuse_analysis_shares_per_feature(tmp_path) -> None:
    from vllm_tiercache.tools.bench.trace.reuse import reuse_tables

    traffic = [Asked((1, 2, 3), None), Asked((1, 2, 4), None), Asked((5,), None), Asked((1, 2, 3), None)]
    tables = reuse_tables(traffic, horizons=(1, 2))
    uses = {row["value"]: row for row in tables["uses before"]}
    assert uses[0]["count"] == 5 and uses[1]["count"] == 3 and uses[2]["count"] == 2
    # first uses: 1, 2 (again at the next request), 3 (again 3 requests later), 4 and 5 (never)
    assert uses[0]["within"] == {1: 2 / 5, 2: 2 / 5} and uses[0]["ever"] == 3 / 5
    tail = {row["value"]: row for row in tables["place from the tail"]}
    assert tail[0]["count"] == 4
    trace = tmp_path / "t.jsonl"
    proc = _cli(str(trace), "--generate", "200", "--reuse")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "-- uses before" in proc.stdout and "never used" in proc.stdout and "optimum" not in proc.stdout


def test_memory_and_disk_through_a_real_store_each_tier_counted(tmp_path) -> None:
    """`--disk-share`: a real store of memory + disk per policy, write-through and exclusive; the hits the
    tiers count add up to the blocks found, the pair stays under the optimum at the combined capacity, the
    exclusive pair finds at least what the write-through one finds, and the table names the split."""
    trace = tmp_path / "gen.jsonl"
    # 150 requests: every replay is a real store's writes and reads, and at 300 the figures this asserts on
    # kept the same margins for twice the time
    write_trace(trace, generate_trace(150, seed=3))
    proc = _cli(str(trace), "--capacities", "10k,40k", "--policies", "lru", "prefix", "--cost-puts", "0",
                "--disk-share", "0.75", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in json.loads(proc.stdout)["rows"]:
        pair = row["memory_disk"]
        assert pair["memory_blocks"] + pair["disk_blocks"] == row["capacity_blocks"]
        assert pair["disk_blocks"] == round(0.75 * row["capacity_blocks"])
        assert pair["policies"] == pair["arrangements"]["write-through"]
        assert pair["disk_policy"] == "prefix"  # the disk tier's default order (`--disk-policy`)
        for arrangement in ("write-through", "exclusive"):
            for policy in ("lru", "prefix"):
                r = pair["arrangements"][arrangement][policy]
                assert r["memory"] + r["disk"] == pytest.approx(r["total"]), r
                assert 0 < r["disk"] and r["total"] <= row["optimum"] + 1e-9, (row, r)
        for policy in ("lru", "prefix"):  # the pair holds memory + disk, not about the disk alone
            assert pair["arrangements"]["exclusive"][policy]["total"] >= pair["policies"][policy]["total"], pair
    table = _cli(str(trace), "--requests", "60", "--capacities", "10k", "--policies", "prefix", "--cost-puts", "0",
                 "--disk-share", "0.5")  # the text report's labels, on the trace's first requests
    assert table.returncode == 0, table.stderr[-3000:]
    assert "memory 0.5 / disk 0.5 of each capacity" in table.stdout and "mem + disk = total" in table.stdout
    assert "(prefix) write-through:" in table.stdout and "(prefix) exclusive:" in table.stdout
    bad = _refused(str(trace), "--disk-share", "1")
    assert bad.returncode == 2 and "--disk-share" in bad.stderr



@pytest.mark.redis
def test_memory_disk_and_a_shared_redis_tier_through_a_real_store(tmp_path) -> None:
    """`--shared-share`: a real store of memory + disk + Redis (a redis-server the bench starts, bounded by
    a maxmemory measured per record): the blocks the lookups found and no tier served are exactly the Redis
    tier's misses (Redis evicted them, or their payload, between the lookup and the read); with memory and
    disk small, Redis serves hits; Redis's own eviction ran (it was bounded); nothing beats the optimum at
    the combined capacity."""
    trace = tmp_path / "gen.jsonl"
    # 150 requests (as above): Redis still evicts thousands of keys and serves hits in each row
    write_trace(trace, generate_trace(150, seed=3))
    proc = _cli(str(trace), "--capacities", "40k,100k", "--policies", "prefix", "--cost-puts", "0",
                "--disk-share", "0.5", "--shared-share", "0.6", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for row in result["rows"]:
        three = row["memory_disk_redis"]
        assert "memory_disk" not in row  # the three tiers replace the pair
        assert three["memory_blocks"] + three["disk_blocks"] + three["redis_blocks"] == row["capacity_blocks"]
        assert three["redis_blocks"] == round(0.6 * row["capacity_blocks"])
        assert 1024 < three["redis_record_cost"] < 4096, three  # a 1 KiB payload, three keys, Redis's overhead
        cells = [three["arrangements"][a]["prefix"] for a in ("write-through", "exclusive")]
        for r in cells:
            # found and not served (lost): each one asked of Redis last and missed there; no tier counted a
            # hit the replay did not see, none was read twice
            assert r["lost"] == r["redis_misses"], r
            # partial: records found with a piece evicted, a miss and never damage (the lookup asks for the head
            # and the first part, so only a piece evicted between the lookup and the read is both)
            assert 0 <= r["partial"] <= r["lost"] and r["corrupt"] == 0, r
            assert r["memory"] > 0 and r["evicted_keys"] > 0, r  # Redis held less than the trace: it evicted
            assert r["total"] <= row["optimum"] + 1e-9, (row, r)
        # Redis is most of the capacity: it serves hits (its eviction is sampled, so not asserted per cell)
        assert sum(r["redis"] for r in cells) > 0, cells
    table = _cli(str(trace), "--requests", "60", "--capacities", "10k", "--policies", "prefix", "--cost-puts", "0",
                 "--disk-share", "0.5", "--shared-share", "0.5")  # the text report's labels, on the first requests
    assert table.returncode == 0, table.stderr[-3000:]
    assert "memory 0.25 / disk 0.25 / Redis 0.5 of each capacity" in table.stdout
    assert "mem + disk + redis = total" in table.stdout and "(prefix) exclusive:" in table.stdout
    for flags, name in ((["--shared-share", "0.5"], "--disk-share"), (["--disk-share", "0.5", "--shared-share", "0"],
                                                                         "--shared-share")):
        bad = _refused(str(trace), *flags)
        assert bad.returncode == 2 and name in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
