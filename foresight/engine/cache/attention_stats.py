"""Accumulating the attention statistics of :mod:`foresight.engine.features` for a bounded cache's slots.

:class:`SlotStatistics` holds, beside the cache's slots, one buffer of the per-slot statistics that are accumulated
(block sum, max, min, the running ``cum`` and ``decay``; per query head; no rows for a policy that reads none), the
newest ``features.QUERY_WINDOW`` queries (the window sums and the ``ahead`` sums are recomputed from them when a policy
asks: :mod:`foresight.engine.cache.kept_queries`) and the decoding
queries whose statistics are deferred to the next eviction (replayed in one batched pass: between evictions the slots
only grow and causality is by token index, so the replay sees exactly the keys each query saw). It accumulates only
what the policy reads (:func:`accumulations`).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from foresight.engine import features
from foresight.engine.attention_shape import AttentionShape

from foresight.engine.cache import kept_queries
from foresight.engine.cache.slot_attention import causal_block, probabilities
from foresight.engine.view import LazyStats

# the per-slot statistics buffer: the rows a block reset zeroes (max, sum) first, sum and cum adjacent (a chunk adds
# its sums to both in one operation), min last (it starts at +inf)
STAT_ORDER = ("max", "sum", "cum", "decay", "min")
_ROWS_OF = {"sum": ("sum", "cum", "decay"), "max": ("max",), "min": ("min",)}  # buffer rows per accumulation
# what is accumulated for each statistic a policy reads: block sums, maxima, minima, or the kept queries
_ACCUMULATION = {"sum": "sum", "cum": "sum", "decay": "sum", "max": "max", "min": "min"}  # else "window"
ALL_ACCUMULATIONS = frozenset({"sum", "max", "min", "window"})
PROB_ACCUMULATIONS = frozenset({"sum", "max", "min"})  # those that need each chunk's attention probabilities
WINDOW_KEYS = frozenset({f"w{w}" for w in features.WINDOWS} | {"pivot32"})
AHEAD_KEYS = frozenset(features.AHEAD_NAMES)


def accumulations(reads) -> frozenset:
    """What must be accumulated for a policy reading the statistics ``reads`` (None: all of them)."""
    if reads is None:
        return ALL_ACCUMULATIONS
    unknown = set(reads) - features.VIEW_STATS
    if unknown:
        raise ValueError(f"unknown attention statistics {sorted(unknown)}; known: {sorted(features.VIEW_STATS)}")
    return frozenset(_ACCUMULATION.get(r, "window") for r in reads)


def buffer_rows(needs: frozenset) -> tuple:
    """The per-slot buffer's rows for the accumulations ``needs``, in STAT_ORDER."""
    return tuple(r for r in STAT_ORDER if any(r in _ROWS_OF[a] for a in needs if a in _ROWS_OF))


@dataclasses.dataclass(frozen=True)
class StatsLayout:
    """The sizes of :class:`SlotStatistics`' buffers: the model's attention ``shape`` (layers, query and KV heads,
    head dimension), the ``batch`` rows, the slots' ``capacity`` and the ``pending`` decoding queries that can wait
    (until the next eviction)."""

    shape: AttentionShape
    batch: int
    capacity: int
    pending: int


class SlotStatistics:
    """The statistics of every slot ``[nl, b, h, g, capacity]`` plus the kept and the deferred queries.

    ``needs``: what is accumulated (see :func:`accumulations`). ``layout``: the buffers' sizes (:class:`StatsLayout`);
    ``device`` and ``dtype``: the cache's (the queries are kept in it; the statistics are float32).
    ``newest_kept``: the cache never evicts its newest W = ``features.QUERY_WINDOW`` slots (its protected window is at
    least W, or it never evicts), so without padding they hold the tokens of the kept queries: the window sums take
    their causal fast path without checking that on the device. ``shifts``: the rotations of the ``ahead``
    statistics (:func:`foresight.engine.cache.rope_shift.shift_tables`, one per ``features.AHEAD_SHIFTS``; None: not offered)."""

    def __init__(self, needs: frozenset, layout: StatsLayout, device, dtype, newest_kept: bool = False,
                 shifts: torch.Tensor | None = None):
        shape, capacity, pending = layout.shape, layout.capacity, layout.pending
        num_layers, head_dim, q_heads = shape.num_layers, shape.head_dim, shape.q_heads
        nl, b, h, d = num_layers, layout.batch, shape.kv_heads, head_dim
        self.needs, self.num_layers, self.head_dim, self.newest_kept = needs, num_layers, head_dim, newest_kept
        self.shifts = shifts
        self.kv_bytes = torch.empty((), dtype=dtype).element_size()  # of the cache's keys and values
        # only the rows of what is accumulated (none for a policy that reads no block statistic), in STAT_ORDER, so
        # that the rows a block reset zeroes (sum, max) come first and min, which starts at +inf, comes last
        self.rows = buffer_rows(needs)
        self._n_reset = sum(r in ("sum", "max") for r in self.rows)
        self.buf = torch.zeros(len(self.rows), nl, b, h, q_heads // h, capacity, device=device, dtype=torch.float32)
        if "min" in self.rows:
            self.buf[-1] = float("inf")
        self._bind()
        W = features.QUERY_WINDOW
        self.recent_q = torch.zeros(nl, b, q_heads, W, d, device=device, dtype=dtype)  # the last W queries
        self.layer_recent_q = [self.recent_q[i] for i in range(nl)]
        self.shares: dict = {}  # Scissorhands' thresholds per slot count (kept_queries.uniform_share)
        self.recent_token = torch.full((W,), -1, device=device, dtype=torch.long)
        self.recent_valid = torch.zeros(b, W, device=device, dtype=torch.bool)
        self.pending_q = torch.zeros(nl, b, q_heads, pending, d, device=device, dtype=dtype)
        self.pending_token = torch.full((pending,), -1, device=device, dtype=torch.long)
        self.pending_valid = torch.zeros(b, pending, device=device, dtype=torch.bool)
        self.n_pending = 0
        self.window_ready = None  # (n, the window sums) the last replay computed (kept_queries.replay_layers)

    def _bind(self):
        """Name the views of the shared buffer (``sum``, ``max``, ``cum``, ``decay``, ``min``; None when not kept) and
        make the per-layer views the chunk path writes (indexing a layer on every call dispatches a select and a
        slice per dimension): ``layer_max``, ``layer_min``, ``layer_sums`` (the sum and cum rows together)."""
        for name in STAT_ORDER:
            setattr(self, name, self.buf[self.rows.index(name)] if name in self.rows else None)
        layers = range(self.num_layers)
        self.layer_max = [self.max[i] for i in layers] if self.max is not None else None
        self.layer_min = [self.min[i] for i in layers] if self.min is not None else None
        s = self.rows.index("sum") if "sum" in self.rows else None
        self.layer_sums = [self.buf[s:s + 2, i] for i in layers] if s is not None else None  # [2, b, h, g, capacity]

    def copy_for(self, needs: frozenset, repeat: int = 1) -> "SlotStatistics":
        """An independent copy that accumulates only ``needs`` (a subset of this one's) from here on, each sequence
        repeated ``repeat`` times in place (a fork of the cache, foresight.engine.cache.fork)."""
        if not needs <= self.needs:
            raise ValueError(f"SlotStatistics.copy_for: {sorted(needs - self.needs)} were not accumulated")
        out = copy.copy(self)
        out.needs, out.rows = needs, buffer_rows(needs)
        out._n_reset = sum(r in ("sum", "max") for r in out.rows)
        rows = [self.rows.index(r) for r in out.rows]
        out.buf = self.buf[rows].repeat_interleave(repeat, dim=2)  # [rows, nl, b, h, g, capacity]
        out._bind()
        out.recent_q = self.recent_q.repeat_interleave(repeat, dim=1)
        out.layer_recent_q = [out.recent_q[i] for i in range(self.num_layers)]
        out.recent_token = self.recent_token.clone()
        out.recent_valid = self.recent_valid.repeat_interleave(repeat, dim=0)
        out.pending_q = self.pending_q.repeat_interleave(repeat, dim=1)
        out.pending_token = self.pending_token.clone()
        out.pending_valid = self.pending_valid.repeat_interleave(repeat, dim=0)
        out.shares, out.window_ready = {}, None
        return out

    # ------------------------------------------------------------------------------------------- slots
    def grow(self, extra: int) -> None:
        """``extra`` more (clean) slots."""
        self.window_ready = None
        cap = self.buf.shape[-1]
        shape = list(self.buf.shape)
        shape[-1] = extra
        buf = torch.cat([self.buf, torch.zeros(shape, dtype=self.buf.dtype, device=self.buf.device)], dim=-1)
        if "min" in self.rows:
            buf[-1, ..., cap:] = float("inf")
        self.buf = buf
        self._bind()

    def evicted(self, order: torch.Tensor, n: int) -> None:
        """After an eviction that keeps the slots ``order`` ([nl, b, h, k], ascending) of the first n: the carried
        statistics (cum, decay) move with their slots and slots k..n become clean; the block statistics (sum, max,
        min) restart, since a new block starts at every eviction, so they are reset rather than moved. The carried
        rows are gathered a few layers at a time (as many as keep the transient copy within one layer's keys and
        values, which the pairs' own gather copies anyway)."""
        self.window_ready = None
        if not self.rows:
            return
        nl, b, h, k = order.shape
        carried = [i for i, r in enumerate(self.rows) if r in ("cum", "decay")]  # adjacent rows
        if carried:
            rows = self.buf[carried[0]:carried[-1] + 1]  # [r, nl, b, h, g, capacity]
            r, g = rows.shape[0], rows.shape[4]
            step = max(1, (2 * self.head_dim * self.kv_bytes) // (r * g * rows.element_size()))
            for lo in range(0, nl, step):
                part = rows[:, lo:lo + step]
                idx = order[None, lo:lo + step, ..., None, :].expand(r, part.shape[1], b, h, g, k)
                part.narrow(5, 0, k).copy_(part.narrow(5, 0, n).gather(5, idx))
            rows.narrow(5, k, n - k).zero_()
        self.reset_block(n)

    def reset_block(self, n: int) -> None:
        """A new block starts over the first n slots: sum, max and min restart; cum and decay carry over."""
        self.window_ready = None
        if not self.rows:
            return
        if self._n_reset:
            self.buf[:self._n_reset].narrow(-1, 0, n).zero_()
        if "min" in self.rows:
            self.buf[-1].narrow(-1, 0, n).fill_(float("inf"))

    def end_block(self, n: int) -> None:
        """At an eviction: ``decay ← DECAY · decay + sum`` over the first n slots."""
        if "sum" in self.needs:
            self.decay[..., :n].mul_(features.DECAY).add_(self.sum[..., :n])

    # ------------------------------------------------------------------------------------ accumulation
    @torch.no_grad()
    def accumulate(self, layer_idx: int, probs, hidden, valid) -> None:
        """Add a group of queries' attention ``probs`` [b, h, g, q, n] to the block statistics (those in ``needs``).
        ``hidden``: the [.., q, n] mask of keys a query could not see (None: only the newest block is causal);
        ``valid`` [b, q]: real (not padding) queries. Without padding the probabilities are overwritten (the newest
        block's hidden keys become +inf for the minimum) unless autograd holds them: call this last."""
        n, q = probs.shape[-1], probs.shape[-2]
        need = self.needs
        if hidden is None:  # no padding: all queries real, only the newest [q, q] block is causal
            w = probs
        else:
            qv = valid[:, None, None, :, None]
            w = probs * qv
        if "max" in need:
            m = self.layer_max[layer_idx].narrow(-1, 0, n)
            torch.maximum(m, w.amax(3), out=m)
        if "sum" in need:  # the block sum and the running cum, one add (in place: `x[.., :n] += y` copies it back)
            self.layer_sums[layer_idx].narrow(-1, 0, n).add_(w.sum(3))
        if "min" in need:
            if hidden is None:  # a hidden key has probability 0: +inf on the newest block's hidden keys, in place
                if probs.requires_grad:  # (not when autograd keeps them for a backward pass through the attention)
                    probs = probs.clone()
                probs[..., n - q:].add_(causal_block(q, probs.device))
                wmin = probs.amin(3)
            else:
                wmin = probs.masked_fill(hidden | ~qv, float("inf")).amin(3)
            m = self.layer_min[layer_idx].narrow(-1, 0, n)
            torch.minimum(m, wmin, out=m)

    def remember_queries(self, layer_idx: int, query, qtok, valid) -> None:
        """Keep the latest W queries (the window statistics are recomputed from them at eviction time)."""
        self.window_ready = None
        q = query.shape[2]
        W = features.QUERY_WINDOW
        recent = self.layer_recent_q[layer_idx]
        if q >= W:
            recent.copy_(query[:, :, q - W:])
        else:
            recent.copy_(torch.cat([recent, query], dim=2)[:, :, -W:])
        if layer_idx == self.num_layers - 1:
            if q >= W:
                self.recent_token, self.recent_valid = qtok[q - W:], valid[:, q - W:]
            else:
                self.recent_token = torch.cat([self.recent_token, qtok])[-W:]
                self.recent_valid = torch.cat([self.recent_valid, valid], 1)[:, -W:]

    def defer(self, layer_idx: int, query, token: int, valid) -> bool:
        """Keep a decoding query [b, Hq, 1, d] for a later :meth:`replay`; after the last layer, record its token
        and validity [b, 1]. Returns whether the pending buffer is full (replay it now)."""
        self.pending_q[layer_idx, :, :, self.n_pending] = query[:, :, 0]
        if layer_idx < self.num_layers - 1:
            return False
        self.pending_token[self.n_pending] = token
        self.pending_valid[:, self.n_pending] = valid[:, 0]
        self.n_pending += 1
        return self.n_pending == self.pending_q.shape[3]

    def defer_at(self, layer_idx: int, query, at: torch.Tensor, token: torch.Tensor) -> None:
        """:meth:`defer` at the device-side index ``at`` [1] (a static decoding step, foresight.engine.static_step): the
        query [b, Hq, 1, d]; after the last layer its token index ``token`` [1], real. The caller counts it."""
        self.pending_q[layer_idx].index_copy_(2, at, query)
        if layer_idx == self.num_layers - 1:
            self.pending_token.index_copy_(0, at, token)
            self.pending_valid.index_fill_(1, at, True)

    @torch.no_grad()
    def replay(self, keys, token, n: int, padded: bool, scaling: float) -> None:
        """Replay the deferred decoding queries against the first n slots (``keys`` [nl, b, h, cap, d], ``token``
        [nl, b, h, cap]): their statistics, as if computed when they ran."""
        P = self.n_pending
        if P == 0:
            return
        qtok, valid = self.pending_token[:P].clone(), self.pending_valid[:, :P].clone()
        batched = not padded and bool(self.needs & PROB_ACCUMULATIONS)
        window = kept_queries.replay_layers(self, keys, n, scaling) if batched else None  # a slice of layers per pass
        for layer in range(self.num_layers):
            query = self.pending_q[layer, :, :, :P]
            if self.needs & PROB_ACCUMULATIONS and not batched:
                probs, hidden = probabilities(query, keys[layer, :, :, :n], token[layer, :, :, :n], qtok, padded,
                                              False, scaling)
                self.accumulate(layer, probs, hidden, valid)
            if "window" in self.needs:
                self.remember_queries(layer, query, qtok, valid)
        self.n_pending = 0
        self.window_ready = None if window is None else (n, window)

    # ---------------------------------------------------------------------------------------- read-out
    def min_stat(self, n: int) -> torch.Tensor:
        return torch.nan_to_num(self.min[..., :n], posinf=0.0)  # 0 for a key no block query saw

    def view_stats(self, n: int, slots, padded: bool, scaling: float, check, missing: str,
                   layers_per_slice: int = 0) -> LazyStats:
        """The statistics of the first n slots (of the :class:`~foresight.engine.cache.slots.SlotStore` ``slots``) for an eviction
        view: the block statistics at once, the window sums and ``min`` when first read (``check()`` raises if the
        view is stale by then); ``missing``: the message for a statistic that is not accumulated."""
        stats, lazy = {}, []
        if "max" in self.needs:
            stats["max"] = self.max[..., :n]
        if "sum" in self.needs:
            stats.update(sum=self.sum[..., :n], cum=self.cum[..., :n], decay=self.decay[..., :n])
        if "window" in self.needs:
            lazy.append((WINDOW_KEYS, lambda: (check(), kept_queries.window_stats(
                self, slots.keys, slots.token, n, padded, scaling, layers_per_slice))[1]))
            if self.shifts is not None:
                lazy.append((AHEAD_KEYS, lambda: (check(), kept_queries.window_stats(
                    self, slots.keys, slots.token, n, padded, scaling, layers_per_slice, ahead=True))[1]))
        if "min" in self.needs:
            lazy.append(({"min"}, lambda: (check(), {"min": self.min_stat(n)})[1]))
        return LazyStats(stats, lazy, missing)
