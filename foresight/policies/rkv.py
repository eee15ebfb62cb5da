"""R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models").

Keep score = λ · importance − (1 − λ) · redundancy, with
* importance: SnapKV's windowed attention (last 8 queries, max-pool kernel 7, GQA max-pooled), normalised
  to sum 1 over the slots;
* redundancy: per key, the mean cosine similarity to the other keys of the same head, with similarities
  below 0.5 zeroed and, among near-duplicates, only the most recent copy spared (it gets 0), then
  softmax-normalised over the slots — as in R-KV's code.
λ = 0.1 (the paper and ForesightKV's appendix E.2; R-KV's code default is 0.07).

Rule: eviction score = −keep score."""

import torch

from foresight.policies.base import Policy, pool_group, register
from foresight.policies.snapkv import maxpool_slots


def redundancy(keys: torch.Tensor, valid: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """keys [..., n, d], valid [..., n] -> redundancy [..., n] (softmax-normalised over valid slots)."""
    k = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = k @ k.transpose(-1, -2)  # [..., n, n]
    n = sim.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=sim.device)
    pair_ok = valid.unsqueeze(-1) & valid.unsqueeze(-2) & ~eye
    sim = torch.where(pair_ok & (sim >= threshold), sim, torch.zeros_like(sim))
    # the most recent of a group of similar keys is spared: a key with any similar *later* key is redundant
    later = torch.triu(torch.ones(n, n, dtype=torch.bool, device=sim.device), diagonal=1)
    has_later_twin = ((sim > 0) & later).any(-1)
    red = sim.sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1)
    red = torch.where(has_later_twin, red, torch.zeros_like(red))
    red = red.masked_fill(~valid, float("-inf"))
    return red.softmax(-1).nan_to_num(0.0)


@register("rkv")
class RKV(Policy):
    def __init__(self, lam: float = 0.1, window: int = 8, kernel: int = 7, threshold: float = 0.5):
        self.lam, self.window, self.kernel, self.threshold = lam, window, kernel, threshold
        self.reads = frozenset({f"w{window}"})

    def score(self, view):
        a = maxpool_slots(pool_group(view.stats[f"w{self.window}"], "max"), self.kernel)
        valid = view.token >= 0
        a = a.masked_fill(~valid, 0.0)
        a = a / a.sum(-1, keepdim=True).clamp(min=1e-12)
        r = redundancy(view.keys, valid, self.threshold)
        return -(self.lam * a - (1 - self.lam) * r)
