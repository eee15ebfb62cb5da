"""The attention statistics that policies and scorers see, defined in one place.

For every cached key and every *query head* of its GQA group (so ``G = q_heads / kv_heads`` values each),
the cache keeps these statistics (all from post-softmax attention probabilities, fp32):

==========  =================================================================================================
``max``     max over the current block's queries of the attention the key received (block = the queries
            since the last eviction, i.e. the L newest tokens when eviction runs)
``min``     min over the block's queries that could see the key (0 for a key no block query saw)
``sum``     sum over the block's queries
``w8``      sum over the last 8 queries of the block (along the *query* axis; the released code slices the
            GQA-head axis by mistake, which makes it a copy of ``sum``)
``w16``     sum over the last 16 queries
``w32``     sum over the last 32 queries
``cum``     running cumulative sum over every query since the key entered the cache, carried across
            evictions (gathered with the kept indices) — H2O's statistic
``decay``   decayed running sum, updated once per block: ``decay ← 0.9 · decay + sum`` at each eviction
==========  =================================================================================================

A scorer may also read ``ahead``: for each shift Δ in ``AHEAD_SHIFTS``, ``a{Δ}`` is the sum over the last 32
queries of the attention each would give the key if it were written Δ tokens later — the same query after RoPE,
rotated by Δ more positions (:mod:`foresight.engine.cache.rope_shift`), softmax over the same keys it sees. The statistics above
are what the recent queries did at their own positions; RoPE's relative rotation changes what the same content
attends to as the distance grows (local heads' nearby keys fade, distant matches stay), and the future queries are
further away. Past attention at the queries' own positions ranks golden's future with a rank correlation of 0.76 on
SmolLM2 (full cache, 32 validation traces); the same queries shifted by 32 reach 0.80, and a per-head ridge of the
block statistics gains 0.08 recall@32 from four shifts. As a trained scorer's input it raises held-out recall@L by
0.03-0.06 and leaves the loss ratio unchanged (``docs/results/smollm2-135m/probe-sft-variants/ahead/``).

A scorer may also read ``heads`` (:func:`head_mean`): the 8 statistics averaged over the query heads of *every* KV head
of the layer that still holds the same token — what the other heads' queries make of it, where ``attn`` gives only its
own group's. And ``age`` (the scorer input ``age``, not an attention statistic): ``log(1 + a)`` for a key written
``a`` tokens before the newest fed token. The key after RoPE does not tell its age (its rotation is by absolute position
and the scorer does not see the current one), so without it a scorer cannot tell an old key whose running sums grew
with time from a young one that is attended now — what KVpop's per-head temporal decay adds to its scores.

Also for policies, not scorer features: ``w1`` (the newest query alone, TOVA's) and ``pivot32`` (Scissorhands' count
of the last 32 queries for which a key got at least the uniform share 1/visible). How they are accumulated, and only
as far as a policy reads them (``Policy.reads``): :mod:`foresight.engine.cache.attention_stats`.
"""

from __future__ import annotations

import torch

from foresight.config.checks import SCORER_INPUTS  # noqa: F401 (what a scorer may read, in input order)

STAT_NAMES = ("max", "min", "sum", "w8", "w16", "w32", "cum", "decay")
WINDOWS = (1, 8, 16, 32)
QUERY_WINDOW = max(WINDOWS)
AHEAD_SHIFTS = (16, 32, 64, 128)  # the ``ahead`` statistics' shifts, in tokens
AHEAD_NAMES = tuple(f"a{s}" for s in AHEAD_SHIFTS)
VIEW_STATS = frozenset(STAT_NAMES) | {"w1", "pivot32"} | set(AHEAD_NAMES)  # every name an EvictionView's stats can hold
DECAY = 0.9
# working memory (values) up to which a per-eviction computation over all layers runs as one batched call; above it,
# in slices of layers, so memory does not grow with depth (the scorer's inputs, the window sums' probabilities)
ALL_LAYERS_MAX_VALUES = 1 << 19


STAT_INPUTS = ("attn", "heads", "ahead")  # the input groups read from the attention statistics
BLOCK_INPUTS = ("attn", "heads")  # those read from the 8 statistics of STAT_NAMES


def feature_dim(head_dim: int, group: int, features=("key", "value", "attn")) -> int:
    """Input width of a scorer: [key; value; 8 statistics × G query heads; 8 statistics over the layer's heads;
    4 ahead statistics × G; age]."""
    d = 0
    if "key" in features:
        d += head_dim
    if "value" in features:
        d += head_dim
    if "attn" in features:
        d += len(STAT_NAMES) * group
    if "heads" in features:
        d += len(STAT_NAMES)
    if "ahead" in features:
        d += len(AHEAD_NAMES) * group
    if "age" in features:
        d += 1
    return d


def age_feature(age: torch.Tensor) -> torch.Tensor:
    """The ``age`` input: ages in tokens ``[..., n]`` (the newest fed token has age 0) -> ``log(1 + age)`` ``[..., n, 1]``,
    fp32 (negative ages, of padding slots, count as 0)."""
    return torch.log1p(age.float().clamp(min=0)).unsqueeze(-1)


def token_age(token: torch.Tensor, seen: int) -> torch.Tensor:
    """Ages ``[..., n]`` of the slots holding token indices ``token`` when ``seen`` tokens have been fed."""
    return seen - 1 - token


def stat_vector(stats, names=STAT_NAMES) -> torch.Tensor:
    """The scorer's attention input: statistics ``{name: [..., g, n]}`` -> ``[..., n, len(names)*g]`` in ``names``
    order, query heads innermost (the same layout in training, in the cache and in the kvpress adapter)."""
    return torch.stack([stats[k] for k in names], dim=-1).movedim(-3, -1).flatten(-2)


def head_mean(values: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``values`` [..., h, n, S] per slot of each KV head, ``token`` [..., h, n] the token each slot holds (any integer
    naming it within one leading index; slots of one head hold distinct tokens) -> [..., h, n, S]: per slot, the mean
    of ``values`` over the KV heads whose slots hold the same token, its own included (the heads evict independently,
    so the same token sits in another slot of each head, or in none). Memory grows with the slots, not the sequence."""
    *lead, h, n, S = values.shape
    if values.numel() == 0:
        return values.float()
    rows = values.reshape(-1, h * n, S)
    key = token.reshape(rows.shape[0], h * n).long()
    key = key - key.min()
    key = key + torch.arange(rows.shape[0], device=key.device)[:, None] * (int(key.max()) + 1)
    _, group = torch.unique(key.reshape(-1), return_inverse=True)
    flat = rows.reshape(-1, S).float()
    sums = flat.new_zeros(int(group.max()) + 1, S).index_add_(0, group, flat)
    counts = flat.new_zeros(sums.shape[0]).index_add_(0, group, flat.new_ones(group.shape[0]))
    return (sums[group] / counts[group, None]).view(values.shape)


def heads_feature(log_stats: torch.Tensor, group: int, token: torch.Tensor) -> torch.Tensor:
    """The scorer input ``heads``: log-statistics ``[..., h, n, 8*group]`` (:func:`stat_vector`'s layout, logged)
    averaged over the group's query heads, then over the KV heads holding the same token (:func:`head_mean`) ->
    ``[..., h, n, 8]``. One definition for the cache, the kvpress press and the stored golden examples."""
    return head_mean(log_stats.unflatten(-1, (len(STAT_NAMES), group)).mean(-1), token)
