"""`tiercache bench tiers`'s seal row: it seals and opens real records and reports them beside a clone of the
same bytes (numbers are the benchmark's, never asserted here)."""

from __future__ import annotations

from vllm_tiercache.tools.bench.tiers import bench_disk_sealed, bench_seal, format_table


def test_the_seal_row_measures_a_round_trip_and_prints_its_target() -> None:
    row = bench_seal(64 << 10, repeat=2)  # bench_seal itself checks that what it opens equals what it sealed
    assert row["tier"] == "seal" and row["size"] == 64 << 10
    assert row["seal_open_gib_s"] > 0 and row["put_ref_gib_s"] > 0 and row["get_ref_gib_s"] > 0
    table = format_table([row])
    assert "seal+open" in table and "GB/s >= 2" in table and "AES-256-GCM" in table


def test_the_disk_sealed_row_compares_a_sealing_disk_store_with_a_plain_one(tmp_path) -> None:
    row = bench_disk_sealed(64 << 10, 2, str(tmp_path))  # checks that the sealed store gives its record back
    assert row["tier"] == "disk-sealed" and row["target"] == 0.91
    assert not list(tmp_path.glob("ring-*.json"))  # the throwaway ring is removed
    assert "disk-sealed" in format_table([row])
