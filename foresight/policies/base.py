"""The policy interface: one method, ``score(view) -> [layers, batch, kv_heads, slots]``, higher = evict first.

A policy sees an :class:`~foresight.engine.view.EvictionView` (keys, values, token indices, attention statistics,
which slots are candidates) for all layers at once; the cache masks protected slots and picks the L to evict.
GQA pooling: statistics come per query head (``[..., g, n]``); :func:`pool_group` reduces a KV head's group.
"""

from __future__ import annotations

import torch

REGISTRY: dict[str, type] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return deco


def pool_group(x: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """[..., g, n] -> [..., n]: pool a statistic over the query heads of a GQA group."""
    if how == "mean":
        return x.mean(-2)
    if how == "max":
        return x.amax(-2)
    if how == "sum":
        return x.sum(-2)
    raise ValueError(f"unknown GQA pooling {how!r} (mean, max, sum)")


class Policy:
    name = "policy"
    # the names of ``view.stats`` (features.VIEW_STATS) that ``score`` reads; None = all of them. The cache computes
    # only these: an empty set lets it run fused attention with no statistics (query-free policies)
    reads: frozenset | None = None

    def score(self, view) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"


class LeastAttended(Policy):
    """Evicts the pairs that received the least attention by one statistic (``stat``), pooled over the GQA
    group's query heads (``pool``; ``default_pool`` per policy)."""

    stat = ""
    default_pool = "mean"

    def __init__(self, pool: str | None = None):
        self.pool = pool or self.default_pool

    @property
    def reads(self) -> frozenset:
        return frozenset({self.stat})

    def score(self, view):
        return -pool_group(view.stats[self.stat], self.pool)
