"""The block-pooled rows ``a_u`` a golden pass collects, and the future scores ``F_t`` they give (definitions in
:mod:`foresight.targets.golden`)."""

from __future__ import annotations

import torch

from foresight.policies.base import pool_group


class BlockPooler:
    """Collects ``a_u`` for every layer and row during a dense pass (used by :func:`foresight_attention`).

    Rows are right-padded traces of ``lengths`` tokens; blocks start at ``start`` (the budget, plus the protected
    prompt when the cache protects it) for every row. Padding queries are left out of the pooling."""

    def __init__(self, num_layers: int, kv_heads: int, lengths: list[int], start: int, interval: int, pool: str,
                 device):
        if pool not in ("mean", "max", "output"):
            raise ValueError(f"golden pooling must be 'mean', 'max' or 'output', got {pool!r}")
        # 'output': the mean over the block's queries (and the group's heads) of how far dropping the key would move
        # each query's attention output (foresight.engine.attention.output_change) instead of its attention probability
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
