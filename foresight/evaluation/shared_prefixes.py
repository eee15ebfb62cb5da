"""The evaluation's shared prefixes: every method of a budget holds the same cache until its first eviction.

At budget B and interval L no method evicts before ``B + L`` tokens (plus a protected prompt): 14–48% of a SmolLM2
realbench trace at B = 128–512. :class:`SharedPrefixes` runs that part once per batch and attention path
(:func:`foresight.engine.rollout.shared_prefix`) and lets each method's rollout continue from a fork of it
(:mod:`foresight.engine.cache.fork`); the losses are the same bit for bit as a rollout from token 0 (tested).
"""

from __future__ import annotations

import dataclasses

from foresight.engine.cache.fork import schedule, shareable, uses_probabilities
from foresight.config.eviction import EvictionSettings
from foresight.engine.rollout import Prefix, RolloutOptions, shared_prefix
from foresight.engine.cache.attention_stats import accumulations


class SharedPrefixes:
    """Prefixes of one budget's batches, built when a first method asks for one; :meth:`clear` at the next budget
    (each holds a copy of the batch's cache at ``B + L`` slots)."""

    def __init__(self, model):
        self.model = model
        self._prefixes: dict = {}
        self.budget = None  # the (B, L) they belong to
        self.built = 0  # prefix passes run (for tests and logs)
        self.reused = 0  # rollouts that continued from one

    def get(self, policy, settings: EvictionSettings, batch: dict, batch_key, recording: bool = False) -> Prefix | None:
        """The prefix of ``batch`` (identified by ``batch_key`` within the budget) for ``policy`` under ``settings``;
        ``recording``: the rollout records its steps (every statistic is accumulated). None for a stateful policy."""
        if not shareable(policy):
            return None
        probs = recording or uses_probabilities(accumulations(getattr(policy, "reads", None)))
        key = (batch_key, probs, schedule(settings, batch["prompt_lens"][0]))
        if key not in self._prefixes:
            self._prefixes[key] = shared_prefix(self.model, batch["ids"], settings,
                                                prompt_len=batch["prompt_lens"][0], attention_mask=batch["mask"],
                                                probabilities=probs,
                                                options=RolloutOptions(full=(batch["loss"], batch["entropy"]), entropy=False))
            self.built += 1
        else:
            self.reused += 1
        return self._prefixes[key]

    def for_batch(self, batch_key) -> "BatchPrefixes":
        """The prefixes of the batch ``batch_key`` (for :func:`foresight.evaluation.evaluate.teacher_forced`)."""
        return BatchPrefixes(self, batch_key)

    def clear(self, budget=None) -> None:
        """Drop every prefix (they belonged to another budget); the next ones are ``budget``'s."""
        self._prefixes.clear()
        self.budget = budget


@dataclasses.dataclass(frozen=True)
class BatchPrefixes:
    """One batch's shared prefixes: the budget's :class:`SharedPrefixes` and the batch's ``key`` within it."""

    prefixes: SharedPrefixes
    key: object

    def get(self, policy, settings: EvictionSettings, batch: dict, recording: bool = False) -> Prefix | None:
        """:meth:`SharedPrefixes.get` for this batch."""
        return self.prefixes.get(policy, settings, batch, self.key, recording)
