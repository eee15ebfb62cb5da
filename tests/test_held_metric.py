"""Pairs held, as the evaluation reports them: per generated token, the pairs its query saw (its own included),
averaged over tokens — not the envelope at the end of each L-token chunk — and the peak, for every method including
the full cache."""

import torch

from conftest import tiny_qwen3
from foresight.config.recipe import EvictionSettings
from foresight.engine.rollout import rollout
from foresight.evaluation.trace_metrics import TraceMetrics
from foresight.policies import make_policy


def test_each_token_saw_the_pairs_before_it_up_to_the_budget_plus_its_chunk():
    model = tiny_qwen3()
    B, L, S = 16, 4, 60
    ids = torch.randint(8, 170, (2, S), generator=torch.Generator().manual_seed(0))
    full = rollout(model, ids)
    t = torch.arange(S, dtype=torch.float32)
    assert torch.equal(full.held_per_token, (t + 1).expand(2, S))  # the full cache: every earlier pair and its own
    res = rollout(model, ids, make_policy("streamingllm"), EvictionSettings(budget=B, interval=L))
    # until the first eviction (B + L tokens) as the full cache; then every chunk of L starts from B
    want = torch.where(t < B + L, t + 1, B + 1 + (t - B - L) % L)
    assert torch.equal(res.held_per_token[0], want) and torch.equal(res.held_per_token[1], want)
    assert res.peak_slots == B + L and res.held_per_token.max().item() == B + L
    assert abs(res.mean_held - want.mean().item()) < 1e-5
    assert res.mean_held < B + L - (L - 1) / 2 + 1e-6  # below the chunk-end envelope by (L - 1) / 2 at least


def test_the_evaluation_row_averages_over_generated_tokens_and_reports_the_peak():
    S, p = 30, 10
    held = (torch.arange(S, dtype=torch.float32) + 1).expand(1, S)
    batch = {"lengths": [S], "prompt_lens": [p], "loss": torch.ones(1, S), "entropy": torch.zeros(1, S),
             "members": ["t0"]}
    m = TraceMetrics()
    m.add(torch.ones(1, S), held, batch, False, EvictionSettings(budget=8, interval=4))
    row = m.row(seed=0)
    assert row["mean_cache"] == round(sum(range(p + 1, S + 1)) / (S - p), 1)  # tokens p..S-1 saw p+1..S pairs
    assert row["peak_cache"] == S
