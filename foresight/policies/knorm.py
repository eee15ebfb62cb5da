"""Key-norm (Knorm; Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): keys with a *low* L2 norm draw more attention, so keep low-norm keys. Query-free: needs no
attention weights, so it suits fused attention kernels.

Rule: eviction score = ||k||₂ (high-norm keys go first)."""

from foresight.policies.base import Policy, register


@register("knorm")
class KeyNorm(Policy):
    reads = frozenset()

    def score(self, view):
        return view.keys.float().norm(dim=-1)
