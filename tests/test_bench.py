"""`make bench` stays runnable: its rollout rows (single sequence with H2O, a GRPO-style group with learned scorers) on
the shipped teacher."""

import pytest

from benchmarks import bench


@pytest.mark.slow
def test_bench_rollout_rows_and_table():
    single = bench.bench_rollout((512,), B=64, L=16, runs=2)
    group = bench.bench_rollout((512,), B=64, L=16, batch=3, policy="learned", golden=False)
    assert single[0]["batch"] == 1 and "golden_s" in single[0] and group[0]["batch"] == 3 and "golden_s" not in group[0]
    lo, hi = single[0]["ratio_range"]
    assert single[0]["runs"] == 2 and lo <= single[0]["rollout_over_dense"] <= hi
    for r in single + group:
        assert r["dense_forward_s"] > 0 and r["rollout_s"] > 0
    gen = [{"new_tokens": 8, "policy": "full", "budget": None, "tokens_per_s": 1.0, "cache_bytes": 1, "peak_rss_mb": 1.0}]
    text = bench.bench_table({"rollout": single, "rollout_group": group, "generation": gen,
                        "scorer_overhead": {"scorer_s": 0.0, "decode_s": 1.0, "scorer_share": 0.0}})
    assert "| 512 | 3 | learned |" in text and "| 512 | 1 | h2o |" in text
