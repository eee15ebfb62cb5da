"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the pairs the *latest* query
attends to most.

Rule: eviction score = -(attention of the newest query, averaged over the GQA group's query heads)."""

from foresight.policies.base import Policy, pool_group, register


@register("tova")
class TOVA(Policy):
    reads = frozenset({"w1"})

    def __init__(self, pool: str = "mean"):
        self.pool = pool

    def score(self, view):
        return -pool_group(view.stats["w1"], self.pool)
