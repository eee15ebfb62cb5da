"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments"): keep keys that are *least similar* to the mean key
(distinctive keys); query-free.

Rule: eviction score = cos(k, anchor), the anchor being the mean of the head's valid keys *normalised* to unit
length, as the paper defines it (most typical keys go first; with raw keys one large-norm key would set the
anchor's direction)."""

import torch

from foresight.policies.base import Policy, register


@register("keydiff")
class KeyDiff(Policy):
    reads = frozenset()

    def score(self, view):
        k = view.keys.float()
        valid = (view.token >= 0).unsqueeze(-1)
        unit = torch.nn.functional.normalize(k, dim=-1)
        anchor = (unit * valid).sum(-2, keepdim=True) / valid.sum(-2, keepdim=True).clamp(min=1)
        return torch.nn.functional.cosine_similarity(k, anchor.expand_as(k), dim=-1)
