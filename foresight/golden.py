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
  resembles costs little.
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

from foresight import attention as attn_mod
from foresight.config import EvictionSettings
from foresight.policies.base import Policy, pool_group
from foresight.shapes import AttentionShape


class BlockPooler:
    """Collects ``a_u`` for every layer and row during a dense pass (used by :func:`foresight_attention`).

    Rows are right-padded traces of ``lengths`` tokens; blocks start at ``start`` (the budget, plus the protected
    prompt when the cache protects it) for every row. Padding queries are left out of the pooling."""

    def __init__(self, num_layers: int, kv_heads: int, lengths: list[int], start: int, interval: int, pool: str,
                 device):
        if pool not in ("mean", "max", "output"):
            raise ValueError(f"golden pooling must be 'mean', 'max' or 'output', got {pool!r}")
        # 'output': the mean over the block's queries (and the group's heads) of how far dropping the key would move
        # each query's attention output (foresight.attention.output_change) instead of its attention probability
        self.output_change = pool == "output"
        self.B, self.L, self.lengths = start, interval, list(lengths)
        self.pool = "mean" if self.output_change else pool
        S = max(self.lengths)
        self.n_blocks = self.blocks(S)
        self.a = torch.zeros(num_layers, len(self.lengths), self.n_blocks, kv_heads, S, device=device)
        self.length = torch.tensor(self.lengths, device=device)
        self.pos = 0  # first query position of the current chunk

    def blocks(self, S: int) -> int:
        """Blocks of a trace of S tokens (the last may be short)."""
        return max(0, -(-(S - self.B) // self.L))

    def add(self, layer_idx: int, probs: torch.Tensor) -> None:
        """probs: [b, Hq, q, k] post-softmax attention of the chunk's queries (positions pos..pos+q): a chunk at or
        after the first block starts on a block boundary and covers one or more blocks (the last may be short)."""
        if self.pos < self.B:
            return
        b, hq, q, k = probs.shape
        u, L, h = (self.pos - self.B) // self.L, self.L, self.a.shape[3]
        m = -(-q // L)  # blocks in this chunk
        p = probs.view(b, h, hq // h, q, k)
        real = (self.pos + torch.arange(m * L, device=probs.device)) < self.length[:, None]  # [b, m·L]
        if q < m * L:  # the trace's last block, short: pad its queries (they are not real)
            p = torch.nn.functional.pad(p, (0, 0, 0, m * L - q))
        p = p.view(b, h, hq // h, m, L, k)
        if real.all():
            pooled_q = p.mean(4) if self.pool == "mean" else p.amax(4)  # [b, h, g, m, k]
        elif self.pool == "mean":
            w = real.view(b, m, L).to(p.dtype)[:, None, None, :, :, None]
            pooled_q = (p * w).sum(4) / w.sum(4).clamp(min=1)
        else:
            pooled_q = p.masked_fill(~real.view(b, m, L)[:, None, None, :, :, None], 0.0).amax(4)
        pooled = pool_group(pooled_q.movedim(3, 1), self.pool)  # [b, m, h, k]
        self.a[layer_idx, :, u:u + m, :, :k] = pooled

    def future(self, row: int = 0) -> torch.Tensor:
        """Row ``row``'s F[t] = max over blocks u >= t + 1 of a_u, for t = 0..n_blocks-1 (zeros past the last
        block): [layers, its blocks, kv heads, its length]."""
        S = self.lengths[row]
        a = self.a[:, row, :self.blocks(S), :, :S]
        suffix = a.flip(1).cummax(1).values.flip(1)  # suffix[u] = max_{u' >= u}
        out = torch.zeros_like(suffix)
        out[:, :-1] = suffix[:, 1:]
        return out

    def futures(self) -> list[torch.Tensor]:
        return [self.future(r) for r in range(len(self.lengths))]


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
    shape = AttentionShape.of(model.config)
    pooler = BlockPooler(shape.num_layers, shape.kv_heads, lengths, start, interval, pool, input_ids.device)
    cache = DynamicCache()
    s, most = 0, queries_per_chunk(b, shape.q_heads, S, interval, input_ids.device)
    with attn_mod.pooling(pooler):
        while s < S:  # chunks never straddle the first block's start; from there they cover whole blocks
            q = min(start - s if s < start else most, most, S - s)
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


def eviction_steps(length: int, prefix: int, settings: EvictionSettings) -> int:
    """How many evictions a trace of ``length`` tokens goes through alone (one per L tokens past prefix + B + L)."""
    over = length - (prefix + settings.budget + settings.interval)
    return max(0, -(-over // settings.interval))
