"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments"): keep keys that are *least similar* to the mean key
(distinctive keys); query-free.

Rule: eviction score = cos(k, mean of the valid keys of the same head) (most typical keys go first)."""

import torch

from foresight.policies.base import Policy, register


@register("keydiff")
class KeyDiff(Policy):
    reads = frozenset()

    def score(self, view):
        k = view.keys.float()
        valid = (view.token >= 0).unsqueeze(-1)
        mean = (k * valid).sum(-2, keepdim=True) / valid.sum(-2, keepdim=True).clamp(min=1)
        return torch.nn.functional.cosine_similarity(k, mean.expand_as(k), dim=-1)
