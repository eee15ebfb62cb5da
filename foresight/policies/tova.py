"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the pairs the *latest* query
attends to most.

Rule: eviction score = -(attention of the newest query, averaged over the GQA group's query heads)."""

from foresight.policies.base import LeastAttended, register


@register("tova")
class TOVA(LeastAttended):
    stat, default_pool = "w1", "mean"
