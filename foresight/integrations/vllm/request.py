"""One request's eviction state inside vLLM's worker: the project's own statistics and eviction step, fed with the
queries vLLM computed and the pairs it cached.

vLLM's fused attention returns no probabilities, so the statistics are rebuilt from the queries the way the project's
cache builds them (:class:`~foresight.engine.cache.attention_stats.SlotStatistics`, the same object): a prompt
chunk's probabilities against the keys up to it, accumulated at once; decoding queries deferred and replayed in one
batch when the pending buffer fills or an eviction needs them; the block before the first eviction starts at the
target (the project's chunks end there, so a chunk crossing it is split); the window sums from the newest 32 queries.
The eviction itself is :func:`foresight.engine.eviction.evict` on this object, so the features, the selection and
its tie order are the engine's (a trained scorer scores the candidate slots only: :mod:`.scoring`). What it keeps
is then written back to the request's first physical positions.

Memory per request beside its pairs: the statistics' per-slot rows, the newest 32 queries and the pending ones
(:class:`SlotStatistics`), and a token index per (layer, KV head, slot).
"""

from __future__ import annotations

import torch

from foresight.config.eviction import EvictionSettings
from foresight.engine import eviction, features
from foresight.engine.attention_shape import AttentionShape
from foresight.engine.cache.attention_stats import (ALL_ACCUMULATIONS, PROB_ACCUMULATIONS, SlotStatistics,
                                                    StatsLayout, accumulations)
from foresight.engine.cache.slot_attention import probabilities
from foresight.engine.cache.slots import SlotStore
from foresight.integrations.vllm.scoring import CandidateScores
from foresight.integrations.vllm.settings import Schedule


class PagedSlots(SlotStore):
    """A :class:`SlotStore` over a request's pairs read from vLLM's paged cache (``kv`` [2, nl, 1, h, n, d]) and its
    persistent token indices (``token`` [nl, 1, h, capacity]). The eviction's :meth:`gather` writes the kept pairs
    straight back to the paged cache (from position ``fixed`` on: the slots below never move) instead of compacting
    this transient copy."""

    def __init__(self, kv: torch.Tensor, token: torch.Tensor, paged, fixed: int):
        self.head_dim, self.kv, self.token, self.extra = kv.shape[-1], kv, token, {}
        self.keys, self.values = kv[0], kv[1]
        self.paged, self.fixed = paged, fixed
        self._layer_views()

    def gather(self, order: torch.Tensor, n: int) -> None:
        k = order.shape[-1]
        self.token.narrow(3, 0, k).copy_(self.token.narrow(3, 0, n).gather(3, order))
        self.token.narrow(3, k, self.capacity - k).fill_(-1)
        lo = min(self.fixed, k)
        self.paged.write_moved(self.kv[:, :, 0], order[:, 0, :, lo:], lo, k)


class PagedRequest:
    """The eviction state of one request (batch 1) whose pairs live in vLLM's paged cache.

    ``policy``: a :class:`~foresight.policies.base.Policy`; ``settings``: its eviction settings; ``schedule``: the
    request's :class:`Schedule`; ``scaling``: the attention's softmax scale; ``shifts``: the ``ahead`` rotations
    (None: not offered)."""

    padded = False
    layer_budget = None
    recorder = None
    whole = None

    def __init__(self, shape: AttentionShape, policy, settings: EvictionSettings, schedule: Schedule, scaling: float,
                 like: torch.Tensor, shifts=None):
        window = settings.window if settings.window is not None else getattr(policy, "layout_window", None)
        self.settings = settings.replace(sinks=max(settings.sinks, getattr(policy, "layout_sinks", 0) or 0),
                                         window=window, protect_prompt=schedule.protected > 0)
        self.window = settings.interval if window is None else window
        self.schedule, self.scaling = schedule, scaling
        self.policy = CandidateScores(policy, self) if CandidateScores.applies(policy) else policy
        self.num_layers, self.kv_heads = shape.num_layers, shape.kv_heads
        self.prompt_len = schedule.prompt_len
        capacity = max(schedule.capacity, schedule.prompt_len)
        needs = accumulations(getattr(policy, "reads", None))
        W = features.QUERY_WINDOW
        layout = StatsLayout(shape, 1, capacity, pending=max(settings.interval, W))
        self.stats = SlotStatistics(needs, layout, like.device, like.dtype, newest_kept=self.window >= W,
                                    shifts=shifts)
        self.token = torch.full((shape.num_layers, 1, shape.kv_heads, capacity), -1, dtype=torch.long,
                                device=like.device)
        self.first_real = torch.zeros(1, dtype=torch.long, device=like.device)
        self.n = self.seen = self.steps = 0
        self.slots: SlotStore | None = None  # the pairs read from the paged cache, while a step needs them
        self.generator, self.policy_state, self.holes = None, {}, [0] * shape.num_layers
        self._checked: set = set()

    # the attributes foresight.engine.eviction reads from a cache
    @property
    def needs(self) -> frozenset:
        return self.stats.needs if self.stats is not None else ALL_ACCUMULATIONS

    @property
    def protected_prefix(self) -> int:
        return self.schedule.protected

    @property
    def keys(self) -> torch.Tensor:
        return self.slots.keys

    @property
    def values(self) -> torch.Tensor:
        return self.slots.values

    def replay_deferred(self) -> None:
        self.stats.replay(self.slots.keys, self.token, self.n, False, self.scaling)

    # ------------------------------------------------------------------------------------------------ a step
    def feed(self, queries: torch.Tensor, paged) -> None:
        """This step's queries of the request [nl, Hq, q, d] (after RoPE, its tokens' KV already written to the paged
        cache ``paged``, a :class:`~foresight.integrations.vllm.layouts.PagedKV`): their statistics, as the project's
        cache accumulates them, then the eviction when the schedule has one after this step."""
        q, start = queries.shape[2], 0
        self._paged, self._end = paged, self.n + q
        while start < q:
            size = q - start
            if self.steps == 0 and self.seen < self.schedule.target < self.seen + size:
                size = self.schedule.target - self.seen  # the block before the first eviction starts at the target
            self._chunk(queries[:, :, start:start + size])
            start += size
        if self.schedule.evicts_after(self.seen):
            self._evict()
        self.slots = self._paged = None

    def _load(self) -> SlotStore:
        if self.slots is None:
            fixed = self.schedule.protected + self.settings.sinks  # slots below never move
            self.slots = PagedSlots(self._paged.read(self._end), self.token, self._paged, fixed)
        return self.slots

    def _chunk(self, queries: torch.Tensor) -> None:
        """One chunk of the project's cache (:func:`foresight.engine.cache.chunks.plan`, then its attention)."""
        st, s, n = self.stats, queries.shape[2], self.n
        first_block = self.steps == 0 and self.seen <= self.schedule.target < self.seen + s
        if st.n_pending and (s > 1 or first_block):
            self._load()
            self.replay_deferred()
        if first_block:
            st.reset_block(n)
        qtok = torch.arange(self.seen, self.seen + s, device=self.token.device)
        self.token[..., n:n + s] = qtok
        if s == 1:
            self._defer(queries)
        else:
            self._attend(queries, qtok)
        self.n, self.seen = n + s, self.seen + s

    def _defer(self, queries: torch.Tensor) -> None:
        """:meth:`SlotStatistics.defer` for every layer at once; a full pending buffer is replayed now."""
        st = self.stats
        if not st.needs:
            return
        at = st.n_pending
        st.pending_q[:, 0, :, at] = queries[:, :, 0]
        st.pending_token[at] = self.seen
        st.pending_valid[:, at] = True
        st.n_pending += 1
        if st.n_pending == st.pending_q.shape[3]:
            self._load()
            st.replay(self.slots.keys, self.token, self.n + 1, False, self.scaling)

    def _attend(self, queries: torch.Tensor, qtok: torch.Tensor) -> None:
        """A chunk's statistics: its queries' probabilities against the keys up to it (the cache's chunk path)."""
        st, s, end = self.stats, queries.shape[2], self.n + queries.shape[2]
        if not st.needs:
            return
        keys = self._load().keys
        valid = torch.ones(1, s, dtype=torch.bool, device=queries.device)
        for layer in range(self.num_layers):
            query = queries[layer][None]
            if st.needs & PROB_ACCUMULATIONS:
                probs, _ = probabilities(query, keys[layer, :, :, :end], None, qtok, False, True, self.scaling)
                st.accumulate(layer, probs, None, valid)
            if "window" in st.needs:
                st.remember_queries(layer, query, qtok, valid)

    def _evict(self) -> None:
        self._load()
        eviction.evict(self, self.n - self.schedule.target)  # its gather writes the kept pairs back (PagedSlots)
