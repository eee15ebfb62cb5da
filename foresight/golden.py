"""Golden Eviction (ForesightKV §3.2): block-pooled *future* attention of the dense model decides, at every
eviction step, which pairs to drop; the scorers learn to reproduce its ranking.

Definitions (per layer; ``B`` budget, ``L`` interval; block ``u`` = queries ``[B + uL, B + (u+1)L)``, the last
block may be shorter):

* ``a_u[h, j] = Pool_{g ∈ group(h)} Pool_{q ∈ block u} A[g, q, j]`` — dense (full-cache) attention of the
  block's queries to key ``j``, pooled over the block's queries and over the query heads of KV head ``h``'s
  GQA group. Pooling is configurable: ``mean`` (default, as the released code; a token that matters to a
  whole block outranks one hit by a single query, which is what the loss under eviction rewards) or ``max``.
  A short last block is averaged over its real queries only (the released code pads it with zeros).
* The engine's eviction step ``t`` runs right after block ``t`` (when the cache holds ``B + L``); its future is
  blocks ``u ≥ t + 1``, so the candidate ``j``'s future score is ``F_t[h, j] = max_{u ≥ t+1} a_u[h, j]``.
* Golden eviction drops the ``L`` candidates with the lowest future score (the newest L are protected by the
  cache); the cache then follows these decisions, so the features seen along the golden trajectory are
  exactly what the engine produces at inference.

Computation: one dense pass in chunks aligned to the blocks; inside the attention call, the chunk's
queries attend to all keys so far (``[heads, L, S]`` at a time, never ``S × S``) and only the pooled rows
``a_u`` are kept: ``n_blocks × kv_heads × S`` values per layer, i.e. ``kv_heads·S²/L``, which is within
``O(heads · L · S)`` as long as ``S ≤ L²`` (32k tokens, L=256: 67 M values per layer). The suffix max over
blocks is taken in place.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from foresight import attention as attn_mod
from foresight.config import EvictionSettings
from foresight.policies.base import Policy, pool_group
from foresight.shapes import AttentionShape


class BlockPooler:
    """Collects ``a_u`` for every layer during a dense pass (used by :func:`foresight_attention`)."""

    def __init__(self, num_layers: int, kv_heads: int, S: int, budget: int, interval: int, pool: str, device):
        if pool not in ("mean", "max"):
            raise ValueError(f"golden pooling must be 'mean' or 'max', got {pool!r}")
        self.B, self.L, self.pool = budget, interval, pool
        self.n_blocks = max(0, -(-(S - budget) // interval))
        self.a = torch.zeros(num_layers, self.n_blocks, kv_heads, S, device=device)
        self.pos = 0  # first query position of the current chunk

    def add(self, layer_idx: int, probs: torch.Tensor) -> None:
        """probs: [b=1, Hq, q, k] post-softmax attention of the chunk's queries (positions pos..pos+q)."""
        q = probs.shape[2]
        u = (self.pos - self.B) // self.L
        if self.pos < self.B:
            return
        p = probs[0]  # [Hq, q, k]
        hq, _, k = p.shape
        h = self.a.shape[2]
        p = p.view(h, hq // h, q, k)
        pooled_q = p.mean(2) if self.pool == "mean" else p.amax(2)  # [h, g, k]
        self.a[layer_idx, u, :, :k] = pool_group(pooled_q, self.pool)

    def future(self) -> torch.Tensor:
        """F[t] = max over blocks u >= t + 1 of a_u, for t = 0..n_blocks-1 (zeros past the last block)."""
        suffix = self.a.flip(1).cummax(1).values.flip(1)  # suffix[u] = max_{u' >= u}
        out = torch.zeros_like(suffix)
        out[:, :-1] = suffix[:, 1:]
        return out


@torch.no_grad()
def block_pooled_attention(model, input_ids: torch.Tensor, settings: EvictionSettings, pool: str = "mean"):
    """One dense chunked pass over ``input_ids`` [1, S] with the blocks of ``settings`` (B, L); returns the
    :class:`BlockPooler` holding ``a_u``."""
    if input_ids.shape[0] != 1:
        raise ValueError("golden labels are computed one trace at a time ([1, S] input)")
    S, budget, interval = input_ids.shape[1], settings.budget, settings.interval
    shape = AttentionShape.of(model.config)
    pooler = BlockPooler(shape.num_layers, shape.kv_heads, S, budget, interval, pool, input_ids.device)
    cache = DynamicCache()
    s = 0
    with attn_mod.pooling(pooler):
        while s < S:
            q = min(budget - s, interval) if s < budget else min(interval, S - s)
            q = min(q, S - s)
            pooler.pos = s
            model(input_ids=input_ids[:, s:s + q], cache=cache, use_cache=True)
            s += q
    return pooler


class GoldenPolicy(Policy):
    """Evicts the candidates with the lowest future score ``F_t`` (from :func:`block_pooled_attention`).

    ``future`` is one trace's ``[nl, n_blocks, h, S]`` (every row of the batch follows it, e.g. G copies of a
    trace) or a stack ``[b, nl, n_blocks, h, S]`` with one trace per row (equal lengths)."""

    reads = frozenset()  # the future is given; a recorder still gets every statistic

    def __init__(self, future: torch.Tensor):
        self.future = future if future.dim() == 5 else future.unsqueeze(0)

    def future_scores(self, view) -> torch.Tensor:
        """[nl, b, h, n] future score of every slot at this step (0 for padding / past the last block)."""
        nl, b, h, n = view.token.shape
        t = view.step
        if t >= self.future.shape[2]:
            return torch.zeros(view.token.shape, device=view.token.device)
        Ft = self.future[:, :, t].expand(b, -1, -1, -1)  # [b, nl, h, S]
        idx = view.token.clamp(min=0).permute(1, 0, 2, 3)  # [b, nl, h, n]
        vals = Ft.gather(-1, idx).permute(1, 0, 2, 3)
        return vals.masked_fill(view.token < 0, 0.0)

    def score(self, view):
        """Eviction order exactly by (future score, then token index): the lowest future score goes first, ties
        (e.g. no future left) towards the oldest token. Slots are sorted by token, so a stable ascending sort of the
        future scores gives that order; the score is minus the rank (no perturbation of the scores, which at long
        contexts would override real gaps between them)."""
        f = self.future_scores(view)
        order = torch.sort(f, dim=-1, stable=True).indices
        n = f.shape[-1]
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=f.device).expand_as(order))
        return -rank.float()
