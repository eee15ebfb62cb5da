"""GRPO's objective on crafted inputs: the reward, the clipped objective and its gradient, group advantages, the
per-draw and per-set ratios, and a group step's window."""

import pytest
import torch

from foresight.engine.rollout import loss_and_entropy
from foresight.targets.reward import low_entropy_mask, reward
from foresight.training.grpo.objective import clipped_objective, group_advantage


def test_reward_on_crafted_vectors():
    full_loss = torch.zeros(10)
    entropy = torch.tensor([9.0, 9, 0.1, 0.2, 5.0, 0.3, 0.4, 0.5, 0.6, 0.7])
    ev = torch.zeros(2, 10)
    ev[0, 3] = 2.0  # low entropy, above eta: counts
    ev[0, 4] = 3.0  # the highest-entropy token after start: outside the lowest 80%
    ev[0, 6] = 1.0  # below eta
    ev[1, 0] = 5.0  # before the first eviction
    low = low_entropy_mask(entropy, start=2, share=0.8)
    assert low.tolist() == [False, False, True, True, False, True, True, True, True, True]  # ceil(0.8*8) = 7
    r = reward(ev, full_loss, entropy, start=2, eta=1.5, share=0.8)
    assert torch.allclose(r, torch.tensor([-4.0 / 7, 0.0]))
    rc = reward(ev, full_loss, entropy, start=2, eta=1.5, share=0.8, normalise="counted")
    assert torch.allclose(rc, torch.tensor([-4.0, 0.0]))


def test_an_absolute_entropy_threshold_counts_near_certain_tokens_the_rank_rule_leaves_out():
    """A near-deterministic trace (the teacher's ledger): most tokens have entropy ~1e-6, the look-ups ~1e-3. The
    lowest 80% by rank leave the look-ups out, so a catastrophic eviction there earns the maximal reward 0; with
    grpo.low_entropy_below they count (and the tokens the model is unsure of still do not)."""
    entropy = torch.full((20,), 1e-6)
    entropy[[12, 15, 18]] = torch.tensor([2e-3, 5e-3, 1e-3])  # look-ups: sure, but the least sure of the trace
    entropy[19] = 2.0  # a real choice
    ev = torch.zeros(1, 20)
    ev[0, 15] = 12.0  # the look-up the eviction broke
    ev[0, 19] = 3.0  # an uncertain token: not the reward's business
    full_loss = torch.zeros(20)
    low = low_entropy_mask(entropy, start=4, share=0.8)
    assert not low[15] and not low[19]  # ceil(0.8 * 16) = 13 tokens at 1e-6
    assert reward(ev, full_loss, entropy, start=4, eta=1.5).item() == 0.0
    low_abs = low_entropy_mask(entropy, start=4, share=0.8, below=0.1)
    assert low_abs[4:19].all() and not low_abs[19] and not low_abs[:4].any()
    r = reward(ev, full_loss, entropy, start=4, eta=1.5, below=0.1)
    assert torch.allclose(r, torch.tensor([-144.0 / 15]))


def test_clipped_objective_gradient_matches_hand_computation():
    lp_old = torch.tensor([0.0, 0.0])
    lp_ref = torch.tensor([0.0, 0.0])
    x = torch.tensor([0.1, 0.5], requires_grad=True)  # lp_new; ratios e^0.1 (inside clip), e^0.5 (clipped)
    adv = torch.tensor([1.0, 1.0])
    loss, st = clipped_objective(x, lp_old, lp_ref, adv, clip_eps=0.2, beta=0.1)
    loss.backward()
    # row 0: d/dx[-e^x·A] = -e^0.1; row 1: clipped (ratio > 1.2 with A > 0) -> surrogate constant
    # k3 = e^(-x) + x - 1 -> d/dx = 1 - e^(-x); mean over 2 rows
    expect = torch.tensor([(-torch.exp(torch.tensor(0.1)) + 0.1 * (1 - torch.exp(torch.tensor(-0.1)))) / 2,
                           (0.1 * (1 - torch.exp(torch.tensor(-0.5)))) / 2])
    assert torch.allclose(x.grad, expect, atol=1e-6)
    assert st["clip_frac"] == 0.5


def test_group_advantage_is_standardised():
    a = group_advantage(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert abs(a.mean().item()) < 1e-6 and abs(a.std().item() - 1) < 1e-4


def test_loss_and_entropy_agree_with_trl_utilities():
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logits = torch.randn(2, 5, 30)
    tgt = torch.randint(0, 30, (2, 5))
    nll, ent = loss_and_entropy(logits, tgt)
    assert torch.allclose(-selective_log_softmax(logits, tgt), nll, atol=1e-5)
    assert torch.allclose(entropy_from_logits(logits), ent, atol=1e-5)


def test_objective_stays_finite_when_an_action_leaves_the_sampling_window():
    from foresight.engine.selection import NEG

    x = torch.tensor([NEG, -3.0], requires_grad=True)
    loss, st = clipped_objective(x, torch.tensor([-5.0, -3.0]), torch.tensor([-5.0, -3.0]),
                                 torch.tensor([1.0, -1.0]), clip_eps=0.2, beta=0.03)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and st["kl"] < float("inf")


@pytest.mark.parametrize("ratio", ["set", "draw"])
def test_a_group_step_keeps_only_the_window_and_its_log_probability_is_the_behaviour_policy_s(qwen3, ratio):
    """group_rollout stores the scorer inputs of the Top-2L window alone; the objective's log-probability from them
    equals the sampler's own (ratio 1 before any update): the set's, or each draw's in draw order."""
    from foresight.config.eviction import EvictionSettings
    from foresight.engine.selection import window_draw_logprobs, window_logits, window_set_logprob
    from foresight.scorers.bank import bank_for_model
    from foresight.training.grpo.rollout import GroupSampling, group_rollout

    bank = bank_for_model(qwen3, hidden=8, seed=1)
    settings = EvictionSettings(budget=24, interval=8)
    ids = torch.randint(8, 170, (1, 90))
    _, steps, overlap = group_rollout(qwen3, bank, ids, GroupSampling(4, 0.05, ratio), settings,
                                      torch.Generator().manual_seed(0), prompt_len=0)
    assert steps and 0.0 <= overlap < 1.0  # at T=0.05 a random scorer's group does not draw identical sets
    for s in steps:
        assert s["x"].shape[-2] == 2 * settings.interval < settings.budget + settings.interval  # the window only
        z = window_logits(bank(s["x"]), s["win"], s["evictable"], 0.05)
        if ratio == "draw":
            lp = window_draw_logprobs(z, s["pos"])
            assert lp.shape == s["pos"].shape and (lp <= 0).all()
            # the draws' terms sum to the ordered sequence's log-probability, which is below the set's
            assert (lp.sum(-1) < window_set_logprob(z, s["pos"]) + 1e-4).all()
        else:
            lp = window_set_logprob(z, s["pos"])
        assert torch.allclose(lp, s["lp_old"], atol=1e-4)


def test_evicted_overlap_measures_how_alike_a_group_s_eviction_sets_are():
    from foresight.training.grpo.rollout import evicted_overlap

    same = torch.arange(6).view(1, 1, 1, 6).expand(2, 4, 3, 6)  # [nl, G, h, L]: every trajectory evicts 0..5
    assert evicted_overlap(same) == 1.0
    disjoint = (torch.arange(4).view(1, 4, 1, 1) * 10 + torch.arange(6)).expand(2, 4, 3, 6)
    assert evicted_overlap(disjoint) == 0.0
    half = disjoint.clone()
    half[:, :, :, :3] = torch.arange(3)  # all share 3 of their 6
    assert abs(evicted_overlap(half) - 0.5) < 1e-6
    g = torch.Generator().manual_seed(0)  # random sets: the binary search counts what comparing every pair counts
    rand = torch.stack([torch.randperm(40, generator=g)[:6] for _ in range(2 * 4 * 3)]).view(2, 4, 3, 6)
    e = rand.movedim(1, 0)
    pairs = (e[:, None, ..., :, None] == e[None, :, ..., None, :]).any(-1).float().mean((-1, -2, -3))
    assert abs(evicted_overlap(rand) - (pairs.sum() - pairs.diagonal().sum()).item() / 12) < 1e-6


def test_per_draw_ratios_clip_what_the_per_set_ratio_lets_through():
    """The probe's failure: a set whose log-probability rose by 3 over L = 32 draws has a per-set ratio e^(3/32),
    inside [0.8, 1.2], so nothing is clipped; when the rise is in 4 draws (0.75 each), those 4 draws' ratios
    (e^0.75) leave the clip range under ``ratio=draw`` and their gradient stops."""
    L = 32
    lp_old = torch.full((1, L), -2.0)
    delta = torch.zeros(1, L)
    delta[0, :4] = 0.75
    adv = torch.ones(1, 1)
    x = (lp_old + delta).requires_grad_(True)
    loss, st = clipped_objective(x.sum(-1), lp_old.sum(-1), lp_old.sum(-1), adv.view(1), 0.2, 0.0, n_actions=L)
    assert st["clip_frac"] == 0.0
    y = (lp_old + delta).requires_grad_(True)
    loss, st = clipped_objective(y, lp_old, lp_old, adv, 0.2, 0.0)
    loss.backward()
    assert st["clip_frac"] == 4 / L
    assert (y.grad[0, :4] == 0).all() and (y.grad[0, 4:] < 0).all()  # clipped draws carry no gradient


def test_the_objective_trains_the_folded_bank_with_the_unfolded_bank_s_loss_and_gradients(qwen3, monkeypatch):
    """step_objective runs the trained bank folded (layer norm folded into the first product): the same loss and the
    same weight gradients as the inference form, up to rounding."""
    from foresight.config.eviction import EvictionSettings
    from foresight.config.recipe import GRPOConfig
    from foresight.scorers.bank import ScorerBank, bank_for_model
    from foresight.training.grpo.objective import step_objective
    from foresight.training.grpo.rollout import GroupSampling, group_rollout

    bank, ref = bank_for_model(qwen3, hidden=8, seed=1), bank_for_model(qwen3, hidden=8, seed=2)
    with torch.no_grad():  # a layer norm away from the identity, so that folding it changes the product
        bank.ln_w.mul_(1.5).add_(0.1 * torch.randn_like(bank.ln_w))
        bank.ln_b.add_(0.1 * torch.randn_like(bank.ln_b))
    cfg = GRPOConfig(group=4, temperature=0.5)
    _, steps, _ = group_rollout(qwen3, bank, torch.randint(8, 170, (1, 90)), GroupSampling.from_grpo(cfg),
                                EvictionSettings(budget=24, interval=8), torch.Generator().manual_seed(0), prompt_len=0)
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75])

    def loss_and_grads():
        bank.zero_grad()
        loss = sum(step_objective(bank, ref, s, adv, cfg)[0] for s in steps)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in bank.named_parameters()}

    plain, asked = ScorerBank.forward_layers, []

    def recorded(self, layers, x, precision="float32", folded=False):
        asked.append(folded)
        return plain(self, layers, x, precision, folded and self is bank)

    monkeypatch.setattr(ScorerBank, "forward_layers", recorded)
    folded = loss_and_grads()
    assert asked and all(asked[::2]) and not any(asked[1::2])  # the trained bank folded, the reference not
    plain_only = lambda self, layers, x, precision="float32", folded=False: plain(self, layers, x, precision, False)
    monkeypatch.setattr(ScorerBank, "forward_layers", plain_only)
    unfolded = loss_and_grads()
    assert torch.allclose(folded[0], unfolded[0], rtol=1e-5, atol=1e-6)
    for k, g in unfolded[1].items():
        assert g.abs().max() > 0, k
        assert torch.allclose(folded[1][k], g, rtol=1e-4, atol=1e-6), k
