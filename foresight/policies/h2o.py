"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference"): keep the
recent window (protected by the cache) and the heavy hitters by *cumulative* attention received.

Rule: eviction score = -(cumulative attention since the key entered the cache, summed over the GQA group's
query heads); the lowest-cumulative pairs go first."""

from foresight.policies.base import LeastAttended, register


@register("h2o")
class H2O(LeastAttended):
    stat, default_pool = "cum", "sum"
