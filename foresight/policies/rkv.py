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


# similarity values per slice of the (layer, sequence, head) rows computed at once: the [n, n] matrices of all layers at
# once were 1.7 GB in float32 at B = 512 (48 SmolLM2 rows) and a dozen passes over them dominated R-KV's evictions
SLICE_VALUES = 1 << 22


def redundancy(keys: torch.Tensor, valid: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """keys [..., n, d], valid [..., n] -> redundancy [..., n] (softmax-normalised over valid slots).

    In slices of the leading rows (``SLICE_VALUES`` similarities each); a key that is not valid is zeroed before the
    product, so its similarities (0) fall below the threshold (> 0) like the excluded pairs they are."""
    if threshold <= 0:
        raise ValueError(f"R-KV's similarity threshold must be > 0, got {threshold}")
    *lead, n, d = keys.shape
    k = torch.nn.functional.normalize(keys.float(), dim=-1).mul_(valid.unsqueeze(-1)).reshape(-1, n, d)
    rows = k.shape[0]
    total, twin = torch.empty(rows, n, device=keys.device), torch.empty(rows, n, dtype=torch.bool, device=keys.device)
    step = max(1, SLICE_VALUES // (n * n))
    for lo in range(0, rows, step):
        part = k[lo:lo + step]
        sim = part @ part.transpose(-1, -2)  # [r, n, n]
        sim.diagonal(dim1=-2, dim2=-1).zero_()  # not a key's own twin
        sim.masked_fill_(sim < threshold, 0.0)
        total[lo:lo + step] = sim.sum(-1)
        # the most recent of a group of similar keys is spared: a key with any similar *later* key is redundant
        twin[lo:lo + step] = sim.triu_(1).amax(-1) > 0
    total, twin = total.view(*lead, n), twin.view(*lead, n)
    red = total / valid.sum(-1, keepdim=True).clamp(min=1)
    red = torch.where(twin, red, torch.zeros_like(red))
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
