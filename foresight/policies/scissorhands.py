"""Scissorhands (Liu et al., 2023, "Scissorhands: Exploiting the Persistence of Importance Hypothesis for
LLM KV Cache Compression at Test Time"): a pair is important if it was *often* among the most attended pairs
over a recent window of queries.

Rule: over the last ``window`` (32) queries, count per key how many times its attention was at least the
query's uniform share 1/(visible keys) (i.e. it was "pivotal" for that query), summed over the GQA group;
eviction score = −count, ties broken by older-first."""

import torch

from foresight.policies.base import Policy, register


@register("scissorhands")
class Scissorhands(Policy):
    reads = frozenset({"pivot32"})

    def __init__(self, window: int = 32):
        self.window = window

    def score(self, view):
        if self.window != 32:
            raise ValueError("scissorhands counts over the last 32 queries (the window the cache keeps)")
        c = view.stats["pivot32"].sum(-2)  # over the group's query heads
        age = -view.token.float() / (view.token.float().amax() + 1.0)  # older first among ties (in (-1, 0])
        return -c + 0.5 * (1 - torch.sigmoid(age))
