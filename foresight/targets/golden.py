"""Golden Eviction (ForesightKV §3.2): block-pooled *future* attention of the dense model decides, at every
eviction step, which pairs to drop; the scorers learn to reproduce its ranking.

Definitions (per layer; ``B`` budget, ``L`` interval; block ``u`` = queries ``[B + uL, B + (u+1)L)``, the last
block may be shorter):

* ``a_u[h, j] = Pool_{g ∈ group(h)} Pool_{q ∈ block u} A[g, q, j]`` — dense (full-cache) attention of the
  block's queries to key ``j``, pooled over the block's queries and over the query heads of KV head ``h``'s
  GQA group. Pooling is configurable: ``mean`` (default, as the released code; a token that matters to a
  whole block outranks one hit by a single query, which is what the loss under eviction rewards) or ``max``.
  A short last block is averaged over its real queries only (the released code pads it with zeros). ``output``
  pools (as ``mean``) what dropping the key would move each query's attention output, ``p_j·‖v_j − o‖/(1 − p_j)``,
  instead of its probability ``p_j`` — a value-aware score: a key attended to whose value the output already
  resembles costs little. ``loss`` (:mod:`foresight.targets.golden_loss`) pools the magnitude of the first-order change of
  the trace's loss when the key is dropped, from one backward of the model per trace (a worse teacher on SmolLM2).
* With a protected prompt of P tokens the blocks start at P + B instead of B (the cache evicts at P + B + L).
* The engine's eviction step ``t`` runs right after block ``t`` (when the cache holds ``B + L``); its future is
  blocks ``u ≥ t + 1``, so the candidate ``j``'s future score is ``F_t[h, j] = max_{u ≥ t+1} a_u[h, j]``.
* Golden eviction drops the ``L`` candidates with the lowest future score (the newest L are protected by the
  cache); the cache then follows these decisions, so the features seen along the golden trajectory are
  exactly what the engine produces at inference.

Computation: one dense pass in chunks aligned to the blocks — one block per forward on a CPU; on an
accelerator as many blocks as keep the chunk's explicit scores under ``PROBS_LIMIT`` values (a single 16k-token
trace of Qwen3-4B: 4 blocks of 128 per forward). Inside the attention call, the chunk's queries attend to all
keys so far (``[heads, q, S]`` at a time, never ``S × S`` on a CPU) and only the pooled rows ``a_u`` are kept:
``n_blocks × kv_heads × S`` values per layer, i.e. ``kv_heads·S²/L``, which is within ``O(heads · L · S)`` as
long as ``S ≤ L²`` (32k tokens, L=256: 67 M values per layer). The suffix max over blocks is taken in place.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from foresight.engine import attention as attn_mod
from foresight.targets.block_pooler import BlockPooler
from foresight.config.eviction import EvictionSettings
from foresight.targets.golden_loss import loss_pooled_cost
from foresight.policies.base import Policy
from foresight.engine.attention_shape import AttentionShape
from foresight.engine.cache_keyword import cache_kwargs


PROBS_LIMIT = 2**28  # values of a chunk's explicit attention scores ([rows, query heads, queries, keys], fp32)


def rows_per_pass(model, interval: int, length: int, limit: int = PROBS_LIMIT) -> int:
    """How many traces one batched golden pass takes so that a chunk's explicit scores ([rows, query heads, L, S]
    fp32) stay under ``limit`` values."""
    return max(1, limit // (AttentionShape.of(model.config).q_heads * interval * max(length, 1)))


def queries_per_chunk(rows: int, q_heads: int, length: int, interval: int, device: torch.device,
                      limit: int = PROBS_LIMIT) -> int:
    """Queries per forward of the golden pass. On an accelerator, the largest whole number of blocks (at least one,
    L queries) whose explicit scores for ``rows`` traces of ``length`` tokens stay under ``limit`` values: a pass of
    few rows runs several blocks per forward (fewer launches, each forward as large as a batched pass's). On a CPU
    one block (L), where launches cost little and the scores' memory (``[rows, heads, L, S]``) is what counts."""
    if device.type == "cpu":
        return interval
    return max(1, limit // (rows * q_heads * max(length, 1) * interval)) * interval


@torch.no_grad()
def block_pooled_attention(model, input_ids: torch.Tensor, settings: EvictionSettings, pool: str = "mean",
                           lengths: list[int] | None = None, prefix: int = 0):
    """One dense chunked pass over ``input_ids`` [b, S] (right-padded traces of ``lengths`` tokens; all S when
    None) with the blocks of ``settings`` (B, L), starting after a protected ``prefix`` (the prompt, when the cache
    protects it: evictions then begin at prefix + B + L); returns the :class:`BlockPooler` holding ``a_u``.
    ``.future()`` is the first row's future, ``.futures()`` every row's."""
    b, S = input_ids.shape
    lengths = [S] * b if lengths is None else list(lengths)
    if len(lengths) != b or max(lengths) > S or min(lengths) < 1:
        raise ValueError(f"lengths {lengths} do not fit input_ids of shape {tuple(input_ids.shape)}")
    S = max(lengths)
    start, interval = prefix + settings.budget, settings.interval
    if pool == "loss":  # first-order loss costs (foresight.targets.golden_loss): a forward and backward per trace
        return loss_pooled_cost(model, input_ids, lengths, start, interval)
    shape = AttentionShape.of(model.config)
    pooler = BlockPooler(shape.num_layers, shape.kv_heads, lengths, start, interval, pool, input_ids.device)
    cache = DynamicCache()
    s, most = 0, queries_per_chunk(b, shape.q_heads, S, interval, input_ids.device)
    with attn_mod.pooling(pooler):
        while s < S:  # chunks never straddle the first block's start; from there they cover whole blocks
            q = min(start - s if s < start else most, most, S - s)
            pooler.pos = s
            model(input_ids=input_ids[:, s:s + q], use_cache=True, **cache_kwargs(model, cache))
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


def eviction_steps(length: int, prefix: int, settings: EvictionSettings) -> int:
    """How many evictions a trace of ``length`` tokens goes through alone (one per L tokens past prefix + B + L)."""
    over = length - (prefix + settings.budget + settings.interval)
    return max(0, -(-over // settings.interval))
