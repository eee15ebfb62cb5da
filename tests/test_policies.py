"""Each heuristic on a crafted case whose correct keep-set is known (one layer, one sequence, one KV head)."""

import pytest
import torch

from foresight.engine.view import EvictionView
from foresight.engine.features import STAT_NAMES
from foresight.policies import make_policy
from foresight.engine.selection import select_topk


def view(n=10, g=2, keys=None, **stats):
    st = {k: torch.zeros(1, 1, 1, g, n) for k in list(STAT_NAMES) + ["w1", "pivot32"]}
    for k, v in stats.items():
        st[k] = torch.as_tensor(v, dtype=torch.float32).expand(1, 1, 1, g, n).clone()
    if keys is None:
        keys = torch.randn(1, 1, 1, n, 4, generator=torch.Generator().manual_seed(0))
    tok = torch.arange(n).view(1, 1, 1, n)
    return EvictionView(keys, keys.clone(), tok, st, torch.ones(1, 1, 1, n, dtype=torch.bool), n_evict=3, step=0,
                        seen=n, prompt_len=0, generator=torch.Generator().manual_seed(0))


def evicted(policy, v, k=3):
    return sorted(select_topk(make_policy(policy).score(v), v.evictable, k).flatten().tolist())


def test_streamingllm_evicts_oldest():
    assert evicted("streamingllm", view()) == [0, 1, 2]


def test_h2o_evicts_lowest_cumulative_attention():
    cum = [5, 0.1, 4, 0.2, 3, 3, 0.3, 9, 9, 9]
    assert evicted("h2o", view(cum=cum)) == [1, 3, 6]


def test_lookahead_evicts_what_the_recent_queries_moved_ahead_would_attend_least():
    a32 = [0.3, 0.0, 0.2, 0.01, 0.1, 0.1, 0.02, 0.1, 0.1, 0.07]
    w32 = [0, 9, 0, 9, 0, 0, 9, 0, 0, 0]  # the same queries at their own positions would disagree
    v = view(w32=w32, a32=a32)
    assert evicted("lookahead", v) == [1, 3, 6] and make_policy("lookahead").reads == {"a32"}


def test_tova_uses_the_newest_query_only():
    w1 = [0.3, 0.0, 0.2, 0.01, 0.1, 0.1, 0.02, 0.1, 0.1, 0.07]
    cum = [0, 9, 0, 9, 0, 0, 9, 0, 0, 0]  # H2O's statistic would disagree
    assert evicted("tova", view(w1=w1, cum=cum)) == [1, 3, 6]


def test_snapkv_maxpool_keeps_neighbours_of_a_spike():
    n = 20
    w8 = torch.full((n,), 0.01)
    w8[10] = 1.0
    w8[0] = 0.5
    w8[19] = 0.4
    ev = evicted("snapkv", view(n=n, w8=w8), k=5)
    assert ev == [4, 5, 6, 14, 15]
    assert not set(ev) & set(range(7, 14))  # kernel 7 around slot 10
    assert not set(ev) & {0, 1, 2, 3} and not set(ev) & {16, 17, 18, 19}


def reference_redundancy(keys, valid, threshold=0.5):
    """R-KV's redundancy computed naively over whole [n, n] matrices (what foresight's sliced version replaced)."""
    k = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = k @ k.transpose(-1, -2)
    n = sim.shape[-1]
    pair_ok = valid.unsqueeze(-1) & valid.unsqueeze(-2) & ~torch.eye(n, dtype=torch.bool)
    sim = torch.where(pair_ok & (sim >= threshold), sim, torch.zeros_like(sim))
    later_twin = ((sim > 0) & torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)).any(-1)
    red = torch.where(later_twin, sim.sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1), torch.zeros(()))
    return red.masked_fill(~valid, float("-inf")).softmax(-1).nan_to_num(0.0)


def test_rkv_redundancy_in_slices_equals_the_whole_matrices(monkeypatch):
    """R-KV's redundancy is computed a few (layer, sequence, head) rows at a time, with padding zeroed instead of an
    [n, n] pair mask: the same values as the whole-matrix computation, bit for bit, with padding and near-twins."""
    from foresight.policies import rkv

    torch.manual_seed(0)
    keys = torch.randn(3, 4, 2, 40, 16).to(torch.bfloat16)
    keys[..., 20:25, :] = keys[..., 5:10, :] + 0.05 * torch.randn(5, 16).to(torch.bfloat16)  # near-duplicates
    valid = torch.ones(3, 4, 2, 40, dtype=torch.bool)
    valid[:, 1, :, :6] = False  # a left-padded sequence
    valid[..., 38:] = False  # empty slots
    monkeypatch.setattr(rkv, "SLICE_VALUES", 3 * 40 * 40)  # slices of 3 rows (the last one shorter)
    got = rkv.redundancy(keys, valid)
    assert torch.equal(got, reference_redundancy(keys, valid))
    with pytest.raises(ValueError, match="threshold"):
        rkv.redundancy(keys, valid, threshold=0.0)


def test_rkv_evicts_the_older_of_duplicate_keys():
    n = 8
    keys = torch.eye(8).view(1, 1, 1, n, 8).clone()
    keys[0, 0, 0, 5] = keys[0, 0, 0, 1]  # slot 1 is an older copy of slot 5
    keys[0, 0, 0, 6] = keys[0, 0, 0, 2]
    w8 = torch.full((n,), 0.1)
    v = view(n=n, keys=keys, w8=w8)
    assert evicted("rkv", v, k=2) == [1, 2]


def test_scissorhands_evicts_least_often_pivotal():
    counts = [10, 0, 7, 1, 8, 9, 2, 5, 6, 7]
    assert evicted("scissorhands", view(pivot32=counts)) == [1, 3, 6]


def test_random_is_seeded_and_uniform():
    v = view(n=50)
    a = make_policy("random").score(view(n=50))
    b = make_policy("random").score(view(n=50))
    assert torch.equal(a, b)
    counts = torch.zeros(50)
    g = torch.Generator().manual_seed(1)
    for _ in range(2000):
        v.generator = g
        counts[select_topk(make_policy("random").score(v), v.evictable, 5).flatten()] += 1
    assert counts.min() > 100 and counts.max() < 320  # expected 200 each


def test_knorm_evicts_high_norm_keys():
    keys = torch.ones(1, 1, 1, 10, 4)
    keys[0, 0, 0, [2, 5, 7]] *= 10
    assert evicted("knorm", view(keys=keys)) == [2, 5, 7]


def test_keydiff_evicts_keys_most_like_the_mean():
    keys = torch.zeros(1, 1, 1, 10, 4)
    keys[..., 0] = 1.0  # typical direction
    keys[0, 0, 0, [0, 4, 8, 9], :] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # distinctive keys
    keys[0, 0, 0, 9] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    ev = evicted("keydiff", view(keys=keys), k=6)
    assert not set(ev) & {0, 4, 8, 9}


def test_unknown_policy_error_lists_known():
    import pytest

    with pytest.raises(ValueError, match="unknown eviction policy 'h20'.*h2o"):
        make_policy("h20")


def test_keydiff_anchor_is_the_mean_of_normalised_keys():
    """One large-norm key must not set the anchor's direction (KeyDiff's anchor averages unit keys)."""
    keys = torch.zeros(1, 1, 1, 6, 2)
    keys[0, 0, 0, 0] = torch.tensor([100.0, 0.0])  # large norm, alone in its direction
    keys[0, 0, 0, 1:] = torch.tensor([0.0, 1.0])
    keys[0, 0, 0, 5] = torch.tensor([0.6, 0.8])
    assert 0 not in evicted("keydiff", view(n=6, keys=keys), k=1)  # with a raw-key mean, key 0 would go first
