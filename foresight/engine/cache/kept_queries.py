"""The statistics computed at an eviction from a :class:`~foresight.engine.cache.attention_stats.SlotStatistics`' kept
queries: the window sums (``w1``…``w32``), Scissorhands' ``pivot32`` counts and the ``ahead`` sums of the same queries
moved Δ positions on (:mod:`foresight.engine.cache.rope_shift`) from its newest ``features.QUERY_WINDOW`` queries, and
the block statistics of the deferred decoding queries (:func:`replay_layers`). ``st`` is the SlotStatistics: its
``recent_q`` / ``recent_token`` / ``recent_valid`` (the kept queries), ``pending_q`` (the deferred ones),
``newest_kept``, ``shifts`` and the cache of Scissorhands' thresholds (``shares``). Both run over as many layers at once
as stay within ``features.ALL_LAYERS_MAX_VALUES`` (the values do not depend on the slicing)."""

from __future__ import annotations

import torch

from foresight.engine import features

from foresight.engine.cache import rope_shift
from foresight.engine.cache.slot_attention import causal_block, grouped_matmul, probabilities


def window_stats(st, keys, token, n: int, padded: bool, scaling: float, layers_per_slice: int = 0,
                 ahead: bool = False) -> dict:
    """Sums over the last 1/8/16/32 queries and Scissorhands' ``pivot32`` counts (``ahead``: the ``a{Δ}`` sums of the
    same queries rotated Δ positions on instead), recomputed from the kept queries against the first n slots (see
    features.py). Their probabilities [layers, b, H, 32, n] are computed for all layers at once up to
    ``features.ALL_LAYERS_MAX_VALUES``, above it as many layers at a time as stay within it, and at least
    ``layers_per_slice``: the cache passes interval // 32, so a slice is at most one layer's attention of a chunk
    (b·H·L·n) where one layer alone exceeds the cap. The values do not depend on the slicing."""
    nl, b, hq, W, _ = st.recent_q.shape
    ready = st.window_ready
    if not ahead and ready is not None and ready[0] == n and not padded:
        return ready[1]  # summed by the replay from the same probabilities (replay_layers)
    step = max(layers_per_slice, features.ALL_LAYERS_MAX_VALUES // max(1, b * hq * W * n)) if layers_per_slice else nl
    part = _ahead_slice if ahead else _window_slice
    if step >= nl or nl * b * hq * W * n <= features.ALL_LAYERS_MAX_VALUES:
        return part(st, slice(None), keys, token, n, padded, scaling)
    parts = [part(st, slice(lo, lo + step), keys, token, n, padded, scaling) for lo in range(0, nl, step)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def newest_are_recent(st, newest: torch.Tensor) -> bool:
    """Whether the newest W slots hold the tokens of the kept queries (a host sync; skipped when ``newest_kept``)."""
    return torch.equal(newest, st.recent_token.expand_as(newest))


def uniform_share(st, n: int, W: int, device) -> torch.Tensor:
    """[W, 1]: 1 / (keys query i sees) for the W newest queries over n slots without padding (Scissorhands'
    threshold), made once per n."""
    t = st.shares.get((n, W, device))
    if t is None:
        if len(st.shares) > 64:
            st.shares.clear()
        seen = torch.arange(n - W + 1, n + 1, device=device, dtype=torch.float32)[:, None]
        t = st.shares[(n, W, device)] = 1.0 / seen
    return t


def visibility(st, token, layers: slice, n: int, padded: bool):
    """Which of the first n slots of ``layers`` each kept query sees (by token index): None when only the newest
    [W, W] block is causal (no padding and the W queries are the tokens of the newest W slots), else the mask
    [nl', b, h, 1, W, n]. One per eviction, shared by the window sums and every shift of the ahead sums."""
    W = st.recent_q.shape[3]
    ktok = token[layers, :, :, :n]
    if not padded and n >= W and (st.newest_kept or newest_are_recent(st, ktok[..., n - W:])):
        return None
    vis = (ktok[:, :, :, None, None, :] <= st.recent_token[None, None, None, None, :, None]) & \
          (ktok >= 0)[:, :, :, None, None, :]
    return vis & (st.recent_token >= 0)[None, None, None, None, :, None]


def recent_probs(st, recent_q, keys, layers: slice, n: int, scaling: float, vis):
    """Attention of the kept queries ``recent_q`` [nl', b, H, W, d] to the first n slots of ``layers`` under the mask
    ``vis`` of :func:`visibility` -> probs [nl', b, h, g, W, n]."""
    nl, b, hq, W, d = recent_q.shape
    h = keys.shape[2]
    g = hq // h
    K = keys[layers, :, :, :n]  # [nl,b,h,n,d]
    scores = grouped_matmul(recent_q * scaling, K.transpose(-1, -2)).view(nl, b, h, g, W, n).float()
    if vis is None:  # query i sees the n - W + i + 1 keys up to itself
        scores[..., n - W:].sub_(causal_block(W, scores.device))
        return scores.softmax(-1)
    probs = scores.masked_fill(~vis, float("-inf")).softmax(-1).nan_to_num(0.0)
    return probs * st.recent_valid[None, :, None, None, :, None]


def _window_slice(st, layers: slice, keys, token, n: int, padded: bool, scaling: float) -> dict:
    recent_q = st.recent_q[layers]
    vis = visibility(st, token, layers, n, padded)
    probs = recent_probs(st, recent_q, keys, layers, n, scaling, vis)
    if vis is None:
        return window_sums(st, probs, n)
    seen = vis.sum(-1, keepdim=True).clamp(min=1)
    return window_sums(st, probs, n, (probs >= 1.0 / seen) & vis)


def window_sums(st, probs: torch.Tensor, n: int, hits: torch.Tensor | None = None) -> dict:
    """The window sums and Scissorhands' ``pivot32`` counts from the kept queries' probabilities [.., W, n] (``hits``:
    which reach their threshold; None: each query sees every slot up to itself, no padding)."""
    if hits is None:
        hits = probs >= uniform_share(st, n, probs.shape[-2], probs.device)  # a hidden key (probability 0) never hits
    out = {"pivot32": hits.sum(-2, dtype=torch.float32)}  # Scissorhands' counts
    for w in features.WINDOWS:
        out[f"w{w}"] = probs[..., -w:, :].sum(-2)
    return out


def _ahead_slice(st, layers: slice, keys, token, n: int, padded: bool, scaling: float) -> dict:
    """The ``a{Δ}`` statistics: the kept queries rotated Δ positions on, each over the keys it sees."""
    recent_q = st.recent_q[layers]
    vis = visibility(st, token, layers, n, padded)
    return {name: recent_probs(st, rope_shift.rotate(recent_q, table), keys, layers, n, scaling, vis).sum(-2)
            for name, table in zip(features.AHEAD_NAMES, st.shifts)}


def replay_layers(st, keys, n: int, scaling: float) -> dict | None:
    """The block statistics (sum, cum, max, min: those in ``st.needs``) of the ``st.n_pending`` deferred decoding
    queries against the first n slots ``keys`` [nl, b, h, cap, d] of a cache without padding, a slice of layers per
    pass (the layers as the batch of one :func:`probabilities`): what :meth:`SlotStatistics.accumulate` adds layer by
    layer, in a few passes instead of one per layer. When the W pending queries are exactly the ones kept for the
    window sums (W of them, the newest slots never evicted), returns those sums from the same probabilities (the
    values :func:`window_stats` would compute again; else None)."""
    P, nl = st.n_pending, st.num_layers
    W = st.recent_q.shape[3]
    window = [] if "window" in st.needs and P == W and n >= W and st.newest_kept else None
    _, b, hq, _, d = st.pending_q.shape
    step = max(1, features.ALL_LAYERS_MAX_VALUES // max(1, b * hq * P * n))
    sums = st.rows.index("sum") if "sum" in st.needs else None
    for lo in range(0, nl, step):
        sl = slice(lo, min(nl, lo + step))
        m = sl.stop - lo
        query = st.pending_q[sl, :, :, :P].reshape(m * b, hq, P, d)
        probs, _ = probabilities(query, keys[sl, :, :, :n].reshape(m * b, -1, n, d), None, None, False, False, scaling)
        probs = probs.view(m, b, *probs.shape[1:])  # [m, b, h, g, P, n]
        if window is not None:
            window.append(window_sums(st, probs, n))
        if "max" in st.needs:
            mx = st.max[sl].narrow(-1, 0, n)
            torch.maximum(mx, probs.amax(4), out=mx)
        if sums is not None:  # the block sum and the running cum in one add
            st.buf[sums:sums + 2, sl].narrow(-1, 0, n).add_(probs.sum(4))
        if "min" in st.needs:  # a hidden key has probability 0: +inf on the newest block's hidden keys
            probs[..., n - P:].add_(causal_block(P, probs.device))
            mn = st.min[sl].narrow(-1, 0, n)
            torch.minimum(mn, probs.amin(4), out=mn)
    if window is None:
        return None
    return {k: torch.cat([part[k] for part in window]) for k in window[0]} if len(window) > 1 else window[0]
