"""GRPO's rollouts: one teacher-forced pass of the frozen LLM in which a trace's G eviction trajectories are drawn
by the current scorers (Top-2L sampler) and the inputs the objective will re-score are kept; and how much the
trajectories of a group overlap (1.0 = no exploration)."""

from __future__ import annotations

import dataclasses

import torch

from foresight.config.eviction import EvictionSettings
from foresight.training.grpo.objective import action_logprob
from foresight.engine.rollout import RolloutOptions, rollout, shared_prefix
from foresight.scorers.bank import LearnedPolicy
from foresight.engine.selection import candidate_window


def evicted_overlap(tokens: torch.Tensor) -> torch.Tensor:
    """Mean share (a 0-d tensor: read once per rollout, not a host sync per eviction) of one trajectory's evicted
    tokens that another trajectory of the group evicted too, over pairs, layers and heads: ``tokens`` [nl, G, h, L].
    1.0 = the group drew the same sets (no exploration)."""
    e = tokens.movedim(1, 0)  # [G, nl, h, L]
    G, shape = e.shape[0], (e.shape[0], *e.shape)
    mine = e.unsqueeze(1).expand(shape).contiguous()  # [g, g', ...]: g's tokens
    theirs = e.sort(-1).values.unsqueeze(0).expand(shape).contiguous()  # [g, g', ...]: g''s, sorted
    # membership by binary search: G²·L values per (layer, head), not the G²·L² of comparing every pair of tokens
    at = torch.searchsorted(theirs, mine).clamp(max=e.shape[-1] - 1)
    same = (theirs.gather(-1, at) == mine).float().mean((-1, -2, -3))  # [G, G]
    return (same.sum() - same.diagonal().sum()) / (G * (G - 1))


@dataclasses.dataclass(frozen=True)
class GroupSampling:
    """How a GRPO group is drawn: ``group`` (G) trajectories of one trace, each eviction a Top-2L draw at
    ``temperature``, with the behaviour log-probabilities of ``ratio`` (``draw`` or ``set``, as
    :func:`foresight.training.grpo.objective.action_logprob`'s)."""

    group: int
    temperature: float
    ratio: str

    @classmethod
    def from_grpo(cls, cfg) -> "GroupSampling":
        """A recipe's ``grpo`` section's (group, temperature, ratio)."""
        return cls(cfg.group, cfg.temperature, cfg.ratio)


@torch.no_grad()
def group_rollout(model, bank, ids: torch.Tensor, sampling: GroupSampling, settings: EvictionSettings, generator,
                  prompt_len: int):
    """One teacher-forced pass of the trace ``ids`` [1, S] with G = ``sampling.group`` trajectories sampled (Top-2L
    at ``sampling.temperature``) under ``settings``, ``generator`` drawing them; returns (per-token losses [G,S],
    steps, mean evicted-token overlap between the trajectories).

    Each step keeps the scorer inputs of the behaviour policy's Top-2L window only ([nl, G, h, 2L, D]: all the
    objective reads, since the window is held fixed), with ``win`` the window's own positions ``0..2L-1``,
    ``evictable`` gathered to it and ``pos`` the draws' window positions in draw order, so that memory grows with
    2L, not with B + L."""
    G, temperature, ratio = sampling.group, sampling.temperature, sampling.ratio
    steps, overlaps = [], []

    def rec(st):
        x = bank.inputs(st["view"])
        k = st["chosen"].shape[-1]
        win, _ = candidate_window(st["scores"], st["evictable"], k)  # the behaviour policy's Top-2L window
        pos = (st["chosen"].unsqueeze(-1) == win.unsqueeze(-2)).float().argmax(-1)
        evictable = st["evictable"].gather(-1, win)
        local = torch.arange(win.shape[-1], device=win.device).expand_as(win)
        lp = action_logprob(st["scores"].gather(-1, win), local, evictable, pos, temperature, ratio)
        x_win = x.gather(-2, win.unsqueeze(-1).expand(*win.shape, x.shape[-1]))
        steps.append({"x": x_win, "win": local, "pos": pos, "evictable": evictable, "lp_old": lp})
        overlaps.append(evicted_overlap(st["token"].gather(-1, st["chosen"])))

    sampled = settings.replace(selection="sample", temperature=temperature)
    # the G rows are the same trace: up to the first eviction (nothing is drawn before it) one row is fed, then its
    # cache is repeated G times (foresight.engine.cache.fork)
    prefix = shared_prefix(model, ids, sampled, prompt_len=prompt_len, probabilities=True) if ids.shape[0] == 1 else None
    res = rollout(model, ids.expand(G, -1), LearnedPolicy(bank), sampled, prompt_len=prompt_len,
                  recorder=rec, options=RolloutOptions(generator=generator, prefix=prefix))
    return res, steps, torch.stack(overlaps).mean().item() if overlaps else 0.0
