"""`tiercache bench kv`'s raw-media row: every medium really moves the bytes, and the table says the share."""

from __future__ import annotations

import itertools

from vllm_tiercache.tools.bench.kv.command import format_table
from vllm_tiercache.tools.bench.kv.medium import raw_medium_times
from vllm_tiercache.tools.redis_server import RedisServer


def test_raw_media_time_every_medium_and_leave_nothing_behind(tmp_path) -> None:
    import redis

    with RedisServer() as server:
        times = raw_medium_times(4 << 20, tmp_path / "media", server.url)
        assert redis.Redis.from_url(server.url).dbsize() == 0  # its GET keys are gone
    for medium in ("memory", "page_cache", "memory_hot", "page_cache_hot", "redis"):
        assert times[medium] is not None and 0 < times[medium] < 5, (medium, times)
    assert times["o_direct"] is None or times["o_direct"] > 0  # None where the filesystem refuses O_DIRECT
    assert list((tmp_path / "media").iterdir()) == []


def test_the_raw_memory_copy_from_dram_moves_bytes_untouched_since_the_set_up() -> None:
    """Each timed round of the from-DRAM copy uses its own part of buffers spread over COLD_SPAN (a hit's
    bytes are not in the CPU cache); the cache-hot copy reuses one."""
    from vllm_tiercache.tools.bench.kv.medium import COLD_SPAN, ROUNDS, _slots

    slots = _slots(4 << 20, cold=True)
    assert len(slots) == ROUNDS + 1 and len(set(slots)) == len(slots)
    assert all(b - a >= 4 << 20 for a, b in itertools.pairwise(slots))
    assert slots[-1] + (4 << 20) >= COLD_SPAN * ROUNDS // (ROUNDS + 1)
    assert _slots(4 << 20, cold=False) == [0]


def test_the_table_prints_each_tiers_share_of_its_raw_medium() -> None:
    row = {"case": "tiered-disk", "label": "4 Tiered hit, disk tier (fresh process)", "status": "ok", "error": None,
           "ttft_median_s": 0.03, "ttft_min_s": 0.02, "ttft_s": [0.03], "num_cached_tokens": [8192],
           "kv_blocks": 10, "hma": False, "ratio_to_resident": 3.0, "ratio_to_cold": None,
           "raw_medium_s": 0.01, "share_of_raw": 0.5}
    report = {"media": {"memory": 0.003, "page_cache": 0.01, "page_cache_hot": 0.004, "o_direct": None, "redis": None},
              "hit_bytes": 32 << 20, "dtype": "float32", "prompt_len": 8193, "prompts": 1, "hit_repeats": 1,
              "model": "m", "min_hit_tokens": 8192, "rows": [row], "targets": []}
    table = format_table(report)
    assert "32.0 MiB a hit loads" in table and "page-cache read 10.00 ms (cache-hot 4.00 ms)" in table
    assert "O_DIRECT read -" in table
    assert "tiered-disk" in table and "0.50" in table and "float32" in table
