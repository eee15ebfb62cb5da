import math

import torch

from foresight.engine.selection import (brute_force_set_logprob, candidate_window, kept_slots, ordered_logprob, sample_top2l,
                                 select_topk, set_logprob)


def test_topk_picks_highest_evictable():
    s = torch.tensor([[0.1, 5.0, 3.0, 9.0, 1.0]])
    ev = torch.tensor([[True, True, True, False, True]])
    assert sorted(select_topk(s, ev, 2)[0].tolist()) == [1, 2]


def test_sampler_stays_in_top2l_window_and_never_repeats():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 40)
    ev = torch.ones_like(s, dtype=torch.bool)
    ev[:, :5] = False
    for _ in range(20):
        ch = sample_top2l(s, ev, 6, generator=g)
        win = candidate_window(s, ev, 6)[0]
        for r in range(3):
            assert len(set(ch[r].tolist())) == 6 and set(ch[r].tolist()) <= set(win[r].tolist())
            assert min(ch[r].tolist()) >= 5


def test_set_logprob_matches_enumeration():
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        s = torch.randn(9, generator=g) * 2
        ev = torch.ones(9, dtype=torch.bool)
        ch = sample_top2l(s, ev, 3, generator=g)
        idx, vals = candidate_window(s, ev, 3)
        pos = [idx.tolist().index(c) for c in ch.tolist()]
        ref = brute_force_set_logprob(vals.tolist(), pos)
        assert abs(set_logprob(s, ev, ch).item() - ref) < 1e-5


def test_ordered_logprob_matches_sequential_formula():
    s = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0, -2.0])
    ev = torch.ones(6, dtype=torch.bool)
    ch = torch.tensor([1, 3])
    win_idx, win = candidate_window(s, ev, 2)  # top-4: 1, 3, 0, 4
    z = {i: s[i].item() for i in win_idx.tolist()}
    p1 = math.exp(z[1]) / sum(math.exp(v) for v in z.values())
    p2 = math.exp(z[3]) / sum(math.exp(v) for k, v in z.items() if k != 1)
    assert abs(ordered_logprob(s, ev, ch).item() - math.log(p1 * p2)) < 1e-5


def test_empirical_set_frequencies_match_set_logprob():
    g = torch.Generator().manual_seed(2)
    s = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    ev = torch.ones(6, dtype=torch.bool)
    counts = {}
    n = 20000
    draws = sample_top2l(s.expand(n, 6), ev.expand(n, 6), 2, generator=g)
    for row in draws.tolist():
        key = tuple(sorted(row))
        counts[key] = counts.get(key, 0) + 1
    for key, c in counts.items():
        p = set_logprob(s, ev, torch.tensor(list(key))).exp().item()
        assert abs(c / n - p) < 0.015, (key, c / n, p)


def test_logprob_outside_window_is_clamped_and_large_k_is_finite():
    s = torch.arange(10.0)
    ev = torch.ones(10, dtype=torch.bool)
    assert set_logprob(s, ev, torch.tensor([0])).item() < -1e3  # slot 0 is not in the top-2 window
    big = torch.randn(2, 600)
    evb = torch.ones_like(big, dtype=torch.bool)
    ch = sample_top2l(big, evb, 128, generator=torch.Generator().manual_seed(0))
    lp = set_logprob(big, evb, ch)
    assert torch.isfinite(lp).all() and (lp < 0).all()
    assert (lp > ordered_logprob(big, evb, ch)).all()  # a set is likelier than any one order of it
    fine = set_logprob(big, evb, ch, grid=4096)
    assert torch.allclose(lp, fine, rtol=1e-4)


def test_ties_are_broken_towards_the_oldest_slot_on_every_device():
    """Max-pooled scores (SnapKV, R-KV) tie between neighbours; ``topk`` breaks ties as each kernel happens to (on
    this CPU it returned slots 198, 200, 199, ... of 300 equal scores), so CPU and GPU kept different pairs. A stable
    order evicts the oldest of equal candidates, the same everywhere."""
    from foresight.engine.selection import candidate_window, select_topk

    flat = torch.zeros(2, 300)
    ok = torch.ones(2, 300, dtype=torch.bool)
    assert select_topk(flat, ok, 5).tolist() == [[0, 1, 2, 3, 4]] * 2
    s = torch.tensor([[1.0, 3.0, 3.0, 3.0, 2.0, 3.0]])
    assert select_topk(s, torch.ones_like(s, dtype=torch.bool), 2).tolist() == [[1, 2]]
    idx, vals = candidate_window(s, torch.tensor([[True, False, True, True, True, True]]), 2)
    assert idx.tolist() == [[2, 3, 5, 4]] and vals.tolist() == [[3.0, 3.0, 3.0, 2.0]]


def test_multinomial_draws_from_every_candidate_and_never_a_protected_slot():
    from foresight.engine.selection import choose

    scores = torch.arange(40, dtype=torch.float32).expand(2, 40) / 100  # nearly flat: every candidate is likely
    evictable = torch.ones(2, 40, dtype=torch.bool)
    evictable[:, :5] = False
    g = torch.Generator().manual_seed(0)
    seen_mn, seen_top2l = set(), set()
    for _ in range(200):
        mn = choose(scores, evictable, 4, "multinomial", 1.0, g)
        t2 = choose(scores, evictable, 4, "sample", 1.0, g)
        assert all(len(set(r)) == 4 for r in mn.tolist()) and (mn >= 5).all()  # without replacement
        seen_mn |= set(mn.flatten().tolist())
        seen_top2l |= set(t2.flatten().tolist())
    assert seen_top2l == set(range(32, 40))  # the Top-2L window: the 8 highest scores
    assert seen_mn == set(range(5, 40))  # every candidate, none of the protected slots


def test_kept_slots_are_the_complement_in_slot_order():
    """kept_slots sorts the drop mask (no host sync) instead of reading nonzero(): the same slots, ascending."""
    g = torch.Generator().manual_seed(3)
    for n, k in ((40, 8), (7, 6), (300, 64)):
        chosen = torch.rand(3, 2, 4, n, generator=g).argsort(-1)[..., :k]
        kept = kept_slots(chosen, n)
        drop = torch.zeros(3, 2, 4, n, dtype=torch.bool).scatter_(-1, chosen, True)
        assert torch.equal(kept, (~drop).nonzero()[:, -1].view(3, 2, 4, n - k))
