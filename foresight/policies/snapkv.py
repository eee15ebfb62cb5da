"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"), in the
decoding-time form of R-KV's code (Cai et al., 2025): the last ``window`` queries are the observation window;
their attention, summed over the window, max-pooled over neighbouring slots (kernel 7) to keep local
context, pooled over the GQA group (max), is the keep score.

Rule: eviction score = -maxpool_7(sum over the last 8 queries of attention), GQA max-pooled."""

import torch.nn.functional as F

from foresight.policies.base import Policy, pool_group, register


def maxpool_slots(x, kernel: int):
    """Max-pool [..., n] along the slot axis (slots are in time order), same length out."""
    if kernel <= 1:
        return x
    shape = x.shape
    y = F.max_pool1d(x.reshape(-1, 1, shape[-1]), kernel_size=kernel, stride=1, padding=kernel // 2)
    return y.reshape(shape)


@register("snapkv")
class SnapKV(Policy):
    def __init__(self, window: int = 8, kernel: int = 7, pool: str = "max"):
        if window not in (1, 8, 16, 32):
            raise ValueError("snapkv window must be one of 1, 8, 16, 32")
        self.window, self.kernel, self.pool = window, kernel, pool
        self.reads = frozenset({f"w{window}"})

    def score(self, view):
        a = pool_group(view.stats[f"w{self.window}"], self.pool)
        return -maxpool_slots(a, self.kernel)
