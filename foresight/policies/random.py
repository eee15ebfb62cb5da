"""Random eviction: every candidate equally likely, independently per (layer, sequence, KV head); seeded by
the cache's generator. With ``protect_prompt`` it is the Random Attention baseline ("Random Attention:
Rethinking KV Cache Eviction for Efficient Reasoning", arXiv 2609.03430), listed as ``random-keep-prompt``."""

import torch

from foresight.policies.base import Policy, register


@register("random")
class Random(Policy):
    reads = frozenset()

    def score(self, view):
        g = view.generator
        dev = view.token.device
        u = torch.rand(view.token.shape, generator=g, device=g.device if g is not None else dev)
        return u.to(dev)
