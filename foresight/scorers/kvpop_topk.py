"""KVpop's running top-k: temporal decay of priorities and the teacher's cut-off per query in O(S log S).

Decay (paper App. B.3): the effective priority of token ``t`` at query ``q`` is
``r_t + ⌊(q − t)/n⌋ · log γ_h``. Its query-dependent part is shared by all tokens only up to the
discretisation, so (as the paper does for its Fenwick pass) we count decay steps on the absolute grid:
``⌊q/n⌋ − ⌊t/n⌋`` steps (never more than one step away from ``⌊(q − t)/n⌋``). The ranking at every query is
then by the *static* priority ``p_t = r_t − ⌊t/n⌋ · log γ_h``; teacher, student, training and inference all use
this one definition (:func:`static_priority`).

Eligible set at query ``q`` (sinks ``s``, window ``w``): ``E(q) = {t : s ≤ t ≤ q − w}``; the teacher keeps the
top ``k`` of ``E(q)``. Since priorities are static and one token enters per query, a dropped token never comes
back, which is what makes this an eviction schedule. The boundary decision at ``q``: the newly evictable
``t_new = q − w`` is kept iff it beats the ``k``-th best of ``E(q − 1)`` (the lowest-ranked token of the current
top-k, ``t_bnd``). A Fenwick tree over the static ranks gives that ``k``-th best by binary lifting.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def static_priority(r: torch.Tensor, token: torch.Tensor, log_gamma: torch.Tensor, step: int) -> torch.Tensor:
    """``r − ⌊t/n⌋·log γ``. r, token: token indices t (same shape as r); log_gamma (≤ 0) broadcastable to r;
    step: n ≥ 1."""
    steps = torch.div(token.clamp(min=0), step, rounding_mode="floor").to(r.dtype)
    return r - steps * log_gamma.to(r.dtype)


def trace_priority(r: torch.Tensor, log_gamma: torch.Tensor, step: int) -> torch.Tensor:
    """:func:`static_priority` of whole traces: r [..., S] indexed by token position (token t at index t)."""
    tok = torch.arange(r.shape[-1], device=r.device).expand_as(r)
    return static_priority(r, tok, log_gamma, step)


def boundary_pairs(p: torch.Tensor, sinks: int, window: int, k: int) -> dict:
    """Teacher decisions at every boundary query, for every head.

    p: [H, S] static priorities. Queries ``q = s + w + k .. S − 1`` (before that, nothing is dropped). Returns
    ``q`` [Q], ``t_new`` [Q] (= q − w), ``t_bnd`` [H, Q] (k-th best of E(q−1)) and ``keep`` [H, Q] (bool).
    """
    H, S = p.shape
    first = sinks + window + k
    if k <= 0:
        raise ValueError(f"KVpop top-k size must be > 0 (budget − sinks − window), got {k}")
    qs = np.arange(first, S)
    if len(qs) == 0:
        return {"q": torch.zeros(0, dtype=torch.long), "t_new": torch.zeros(0, dtype=torch.long),
                "t_bnd": torch.zeros(H, 0, dtype=torch.long), "keep": torch.zeros(H, 0, dtype=torch.bool)}
    pn = p.detach().float().cpu().numpy()
    order = np.argsort(-pn, axis=1, kind="stable")  # order[h, r] = token of rank r (0 = best)
    rank = np.empty_like(order)
    rank[np.arange(H)[:, None], order] = np.arange(S)[None, :]
    tree = np.zeros((H, S + 1), dtype=np.int64)
    rows = np.arange(H)
    log = 1 << int(math.floor(math.log2(S)))

    def insert(t: int):
        i = rank[:, t] + 1
        while True:
            live = i <= S
            if not live.any():
                break
            tree[rows[live], i[live]] += 1  # one entry per head: no repeated index
            i = np.where(live, i + (i & -i), i)

    def kth() -> np.ndarray:  # 0-based rank of the k-th smallest inserted rank, per head
        pos = np.zeros(H, dtype=np.int64)
        rem = np.full(H, k, dtype=np.int64)
        step = log
        while step:
            nxt = pos + step
            ok = nxt <= S
            val = np.where(ok, tree[rows, np.minimum(nxt, S)], 0)
            go = ok & (val < rem)
            pos = np.where(go, nxt, pos)
            rem = np.where(go, rem - val, rem)
            step >>= 1
        return pos  # the k-th smallest is at 1-based index pos + 1, i.e. 0-based rank pos

    for t in range(sinks, first - window):  # E(first − 1) = {s .. first − w − 1}: k tokens
        insert(t)
    t_bnd = np.empty((H, len(qs)), dtype=np.int64)
    for j, q in enumerate(qs):
        t_bnd[:, j] = order[rows, kth()]
        insert(q - window)
    t_new = qs - window
    keep = pn[:, t_new] > pn[rows[:, None], t_bnd]
    return {"q": torch.from_numpy(qs), "t_new": torch.from_numpy(t_new), "t_bnd": torch.from_numpy(t_bnd),
            "keep": torch.from_numpy(keep)}


def topk_sets(p: torch.Tensor, sinks: int, window: int, k: int, q: int) -> torch.Tensor:
    """[H, S] bool: the top-k of E(q) by static priority (the long-range tokens held at query q)."""
    H, S = p.shape
    elig = torch.zeros(S, dtype=torch.bool, device=p.device)
    elig[sinks: max(sinks, q - window + 1)] = True
    kk = min(k, int(elig.sum()))
    idx = p.masked_fill(~elig, float("-inf")).topk(kk, -1).indices
    return torch.zeros(H, S, dtype=torch.bool, device=p.device).scatter_(1, idx, True)


def topk_recall(p_teacher: torch.Tensor, p_student: torch.Tensor, sinks: int, window: int, k: int,
                queries) -> float:
    """Top-k retention recall (paper Fig. 7): share of the teacher's top-k of E(q) that the student's top-k
    also holds, averaged over heads and the given queries."""
    vals = []
    for q in queries:
        a = topk_sets(p_teacher, sinks, window, k, q)
        b = topk_sets(p_student, sinks, window, k, q)
        vals.append(((a & b).sum(-1).float() / a.sum(-1).clamp(min=1).float()).mean())
    return float(torch.stack(vals).mean()) if vals else float("nan")
