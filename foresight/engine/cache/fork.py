"""Forking a bounded cache at its first eviction point: one prefix pass serves every policy of the same layout.

Until its first eviction (``B + L`` tokens, plus a protected prompt) a
:class:`~foresight.engine.cache.bounded.BoundedCache` holds the same pairs whatever its policy: a policy only changes
which statistics are accumulated beside them, and whether the attention runs fused (no statistic needs the
probabilities) or from explicit probabilities (some do) — the two give outputs that differ by float rounding. So an
evaluation of many methods at one budget, or GRPO's G trajectories of one trace, can run that prefix once per attention
path and hand each policy a copy (:func:`fork`) that continues from it; the copy's results equal a rollout from token 0
bit for bit (tested), as long as its attention path is the prefix's."""

from __future__ import annotations

import torch

from foresight.engine import features
from foresight.engine.cache.bounded import BoundedCache
from foresight.config.eviction import EvictionSettings
from foresight.policies.base import Policy
from foresight.engine.cache.attention_stats import PROB_ACCUMULATIONS


class PrefixPolicy(Policy):
    """The policy of a prefix pass: it accumulates what its forks may read (every statistic when ``probabilities``,
    else only the kept queries, for the window sums) and never evicts."""

    name = "prefix"

    def __init__(self, probabilities: bool):
        self.reads = None if probabilities else frozenset({"w1"})

    def score(self, view) -> torch.Tensor:
        raise RuntimeError("a prefix pass ends before the first eviction; fork its cache (foresight.engine.cache.fork.fork)")


def uses_probabilities(needs: frozenset) -> bool:
    """Whether a cache accumulating ``needs`` attends from explicit probabilities (else fused attention)."""
    return bool(needs & PROB_ACCUMULATIONS)


def schedule(settings: EvictionSettings, prompt_len: int | None) -> tuple:
    """What decides a bounded cache's chunks up to its first eviction: budget, interval, the protected prompt and the
    layers' shares of the budget (the other settings act at evictions only)."""
    return settings.budget, settings.interval, settings.protected_prefix(prompt_len), tuple(settings.layer_budgets)


def shareable(policy) -> bool:
    """Whether ``policy`` can continue from a shared prefix: a stateful policy (``observe``) must see every pair
    arrive."""
    return not hasattr(policy, "observe")


def fork(cache: BoundedCache, policy, settings: EvictionSettings | None = None, generator: torch.Generator | None = None,
         recorder=None, repeat: int = 1) -> BoundedCache:
    """A copy of ``cache`` (a prefix pass's, at or before its first eviction) for ``policy`` under ``settings`` (the
    prefix's when None; they may differ in what acts at evictions only: sinks, protected window, selection), with its
    own ``generator`` and ``recorder``, each sequence repeated ``repeat`` times (GRPO's G trajectories of one trace).
    It accumulates only what ``policy`` reads from here on; ``cache`` is left as it was, ready for the next fork."""
    if cache.full or cache.slots is None or cache.steps or cache.chunk is not None:
        raise ValueError("fork: the cache must be a bounded one that has been fed and has not evicted yet")
    if not shareable(policy):
        raise ValueError(f"fork: {policy!r} is stateful (it observes every pair); roll it out from token 0")
    new = BoundedCache(cache.model_config, policy, settings or cache.resolved, cache.prompt_len, recorder, generator)
    if schedule(new.resolved, cache.prompt_len) != schedule(cache.resolved, cache.prompt_len):
        raise ValueError(f"fork: budget, interval or protected prompt {schedule(new.resolved, cache.prompt_len)} "
                         f"differ from the prefix's {schedule(cache.resolved, cache.prompt_len)}: another schedule")
    needs = new.accumulated()
    if uses_probabilities(needs) != uses_probabilities(cache.needs) or not needs <= cache.needs:
        raise ValueError(f"fork: {policy!r} accumulates {sorted(needs)}, which the prefix pass ({sorted(cache.needs)}) "
                         "does not provide with the same attention path")
    new.settings = new.resolved.replace(protect_prompt=cache.settings.protect_prompt)  # the prompt-overflow fallback
    new.slots = cache.slots.copy(repeat)
    new.stats = cache.stats.copy_for(needs, repeat)
    new.stats.newest_kept = new.window >= features.QUERY_WINDOW  # as the new cache's own allocation would set it
    new.first_real = cache.first_real.repeat_interleave(repeat)
    for name in ("n", "seen", "padded", "peak_slots", "scaling", "all_started", "chunk_real"):
        setattr(new, name, getattr(cache, name))
    return new
