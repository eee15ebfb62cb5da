"""A learned policy scored on the eviction candidates only.

The project's eviction step asks its policy for the scores of every slot and then masks the protected ones (the
protected prompt, the sinks, the newest window). For a trained scorer bank, whose MLP is the bulk of an eviction's
work, scoring those slots is wasted: with the prompt protected it is a third of the slots at B=256 on realbench
prompts. :class:`CandidateScores` hands the bank only the slots between the protected prefix and the window (the
statistics are still computed over every key, so each candidate's inputs are unchanged) and gives the others a score
that the selection never reads. A bank that reads ``heads`` (statistics averaged over the KV heads holding the same
token, which depends on every slot) is scored whole.
"""

from __future__ import annotations

import dataclasses

import torch


class CandidateScores:
    """Wraps a :class:`~foresight.scorers.bank.LearnedPolicy` for an eviction cache whose candidates are the slots
    ``[protected_prefix + sinks, n - window)`` of every row (no padding)."""

    def __init__(self, policy, cache):
        self.policy, self.cache = policy, cache
        self.reads, self.name = policy.reads, policy.name
        for attr in ("layout_window", "layout_sinks"):
            if hasattr(policy, attr):
                setattr(self, attr, getattr(policy, attr))

    @staticmethod
    def applies(policy) -> bool:
        bank = getattr(policy, "bank", None)
        return bank is not None and "heads" not in bank.features and not hasattr(policy, "observe")

    def score(self, view) -> torch.Tensor:
        n = view.token.shape[-1]
        lo = min(self.cache.protected_prefix + self.cache.settings.sinks, n)
        hi = max(lo, n - min(self.cache.window, n))
        if hi - lo == n:
            return self.policy.score(view)
        names = self.policy.bank.stat_names if self.policy.bank.reads_attention else ()
        part = dataclasses.replace(view, keys=view.keys[..., lo:hi, :], values=view.values[..., lo:hi, :],
                                   token=view.token[..., lo:hi], evictable=view.evictable[..., lo:hi],
                                   stats={k: view.stats[k][..., lo:hi] for k in names},
                                   slot={k: v[..., lo:hi] for k, v in view.slot.items()})
        out = torch.zeros(view.token.shape, dtype=torch.float32, device=view.token.device)
        out[..., lo:hi] = self.policy.score(part)
        return out
