"""What a policy sees at one eviction step: :class:`EvictionView` (all layers at once) and its statistics.

Shapes use nl = layers, b = batch, h = KV heads, g = query heads per KV head, n = slots in use, d = head dim.
"""

from __future__ import annotations

import dataclasses

import torch

from foresight.engine import features


class LazyStats(dict):
    """The statistics of one eviction step. Some are computed only when a policy asks for one (the window sums,
    recomputed from the kept queries, and ``min``: H2O, for instance, reads neither). ``lazy``: a list of (names,
    function returning a dict with those names). ``missing``: the message for a statistic that was not accumulated
    (the policy did not declare it)."""

    def __init__(self, base: dict, lazy: list, missing: str = ""):
        super().__init__(base)
        self._lazy = list(lazy)
        self._missing = missing

    def __missing__(self, key):
        for i, (names, fn) in enumerate(self._lazy):
            if key in names:
                self.update(fn())
                del self._lazy[i]
                return dict.__getitem__(self, key)
        if key in features.VIEW_STATS and self._missing:
            raise KeyError(f"attention statistic {key!r} was not computed: {self._missing}")
        raise KeyError(key)

    def materialize(self) -> "LazyStats":
        for _, fn in self._lazy:
            self.update(fn())
        self._lazy = []
        return self


@dataclasses.dataclass
class EvictionView:
    """What a policy sees at one eviction step (all layers at once)."""

    keys: torch.Tensor  # [nl, b, h, n, d]
    values: torch.Tensor  # [nl, b, h, n, d]
    token: torch.Tensor  # [nl, b, h, n] token index, -1 for pads
    stats: dict  # name -> [nl, b, h, g, n] (features.VIEW_STATS)
    evictable: torch.Tensor  # [nl, b, h, n] candidates (not protected, not padding)
    n_evict: int
    step: int
    seen: int  # tokens fed so far
    prompt_len: int
    generator: torch.Generator | None = None
    slot: dict = dataclasses.field(default_factory=dict)  # name -> [nl, b, h, n]: per-slot data of stateful policies

    def snapshot(self) -> "EvictionView":
        """A copy that later cache updates cannot change (the cache's tensors are reused in place)."""
        stats = self.stats.materialize() if isinstance(self.stats, LazyStats) else self.stats
        return dataclasses.replace(self, keys=self.keys.clone(), values=self.values.clone(), token=self.token.clone(),
                                   stats={k: v.clone() for k, v in stats.items()}, evictable=self.evictable.clone(),
                                   slot={k: v.clone() for k, v in self.slot.items()})

    def attn_features(self) -> torch.Tensor:
        """[nl, b, h, n, 8*g]: the statistics in features.STAT_NAMES order, query heads innermost."""
        return features.stat_vector(self.stats)


def candidates(token: torch.Tensor, window: int, sinks: int, first_real: torch.Tensor,
               protected_prefix: int) -> torch.Tensor:
    """[nl, b, h, n] eviction candidates among slots holding ``token`` [nl, b, h, n]: real tokens outside the newest
    ``window`` slots, the first ``sinks`` real tokens of each row (``first_real`` [b]: the index of its first real
    token) and the first ``protected_prefix`` slots."""
    n = token.shape[-1]
    evictable = token >= 0
    slot = torch.arange(n, device=token.device)
    evictable &= (slot < n - min(window, n))
    if sinks:
        first = first_real[None, :, None, None]
        evictable &= ~((token >= 0) & (first >= 0) & (token < first + sinks))
    if protected_prefix:
        evictable &= slot >= protected_prefix
    return evictable
