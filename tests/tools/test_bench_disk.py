from tools.bench_disk import run_set, summarize_set


def test_bench_disk_summary_ratios_are_tier_over_raw_medians():
    times = {"raw_write": [2.0, 1.0, 4.0], "tier_write": [1.0], "raw_read": [1.0], "tier_read": [2.0]}
    row = summarize_set("s", 1000, 1000, times, True)
    assert row["raw_write_gbps"] == 1000 * 1000 / 2.0 / 1e9  # the median of the three
    assert row["write_ratio_vs_raw"] == 2.0 and row["read_ratio_vs_raw"] == 0.5


def test_bench_disk_small_set_round_trips_and_cleans_up(tmp_path):
    # A tiny set through the real store and dd: every block read back is checked in run_set.
    row = run_set(tmp_path / "b", "tiny", 4, 64 << 10, threads=2, repeats=1, read_threads=(1, 3),
                  write_threads=(1,))
    assert row["blocks"] == 4 and row["tier_read_gbps"] > 0 and row["raw_read_gbps"] > 0
    assert row["pool_read_gbps"] > 0 and row["tier_read_t1_gbps"] > 0 and len(row["tier_read_t3_gbps_each"]) == 1
    assert row["tier_write_t1_gbps"] > 0
    assert not (tmp_path / "b" / "tiny-tier").exists() and not (tmp_path / "b" / "tiny-raw").exists()
