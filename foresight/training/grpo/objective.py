"""GRPO's objective (:mod:`foresight.training.grpo.stage` describes it in full): the trajectory reward under the recipe's
settings, the group-normalised advantage, the clipped surrogate with a k3 KL to the SFT scorers, and the log-probability
of a drawn eviction action (the set's, or each ordered draw's) on the behaviour policy's Top-2L window."""

from __future__ import annotations

import torch

from foresight.targets.reward import reward as compute_reward
from foresight.engine.selection import window_draw_logprobs, window_logits, window_set_logprob


def trajectory_reward(loss, full_loss, full_entropy, start: int, grpo_cfg) -> torch.Tensor:
    """:func:`foresight.targets.reward.reward` under the recipe's ``grpo`` settings."""
    return compute_reward(loss, full_loss, full_entropy, start, grpo_cfg.eta, grpo_cfg.low_entropy_share,
                          grpo_cfg.normalise, grpo_cfg.low_entropy_below)


def group_advantage(r: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    from trl.trainer.utils import nanstd

    return (r - r.mean()) / (nanstd(r) + eps)


def clipped_objective(lp_new, lp_old, lp_ref, adv, clip_eps: float, beta: float, n_actions: int = 1):
    """Per-row loss terms (to be averaged): lp_* [..., G, ...] broadcastable with adv. Returns (loss, stats).

    ``n_actions``: evictions in each row's action set when ``lp_*`` are set log-probabilities (``grpo.ratio=set``:
    the log-ratio is shared out over them); 1 when they are per-draw already (``ratio=draw``). Log-ratios are
    clamped to ±20 so that an action outside the current Top-2L window (log-prob NEG) cannot make the objective
    infinite."""
    ratio = torch.exp(((lp_new - lp_old) / n_actions).clamp(-20.0, 20.0))
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    d = ((lp_ref - lp_new) / n_actions).clamp(-20.0, 20.0)
    kl = torch.exp(d) - d - 1
    loss = (-surr + beta * kl).mean()
    clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).float().mean()
    return loss, {"kl": kl.mean().item(), "clip_frac": clipped.item(), "ratio": ratio.mean().item()}


def action_logprob(scores, win, evictable, pos, temperature: float, ratio: str) -> torch.Tensor:
    """log π of the drawn action on the window ``win``: the set's ([...]) under ``ratio=set``, each draw's
    ([..., L]) under ``ratio=draw``."""
    z = window_logits(scores, win, evictable, temperature)
    return window_draw_logprobs(z, pos) if ratio == "draw" else window_set_logprob(z, pos)


def step_objective(bank, ref, s: dict, adv: torch.Tensor, grpo_cfg):
    """One recorded step's clipped objective with KL to ``ref``, and its KL and clip fraction (as tensors). The trained
    bank runs folded (:meth:`foresight.scorers.bank.ScorerBank.forward_layers`): its backward needs only the weights'
    gradients."""
    phi = bank(s["x"], folded=True)
    with torch.no_grad():
        phi_ref = ref(s["x"])
    args = (s["win"], s["evictable"], s["pos"], grpo_cfg.temperature, grpo_cfg.ratio)
    lp_new, lp_ref = action_logprob(phi, *args), action_logprob(phi_ref, *args)
    per_draw = grpo_cfg.ratio == "draw"
    loss, st = clipped_objective(lp_new, s["lp_old"], lp_ref, adv.view(1, -1, 1, *((1,) if per_draw else ())),
                                 grpo_cfg.clip_eps, grpo_cfg.beta, n_actions=1 if per_draw else s["pos"].shape[-1])
    return loss, torch.tensor(st["kl"]), torch.tensor(st["clip_frac"])
