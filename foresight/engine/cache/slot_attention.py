"""Attention over a bounded cache's slots, causal by token index.

A slot holds the token index of its pair (``-1`` for padding and empty slots); query ``t`` may see a key of token
``j`` iff ``0 <= j <= t``. The queries of a forward are the tokens of the last ``q`` slots, so every older slot is
visible to all of them and, when no padding was ever fed, only the newest ``[q, q]`` block is causal
(:func:`causal_block`). With padding, visibility is built in full from the token indices (:func:`visible`).
Shapes: ``b`` batch, ``h`` KV heads, ``g`` query heads per KV head, ``q`` queries, ``n`` slots, ``d`` head dim.
"""

from __future__ import annotations

import torch

_CAUSAL_BLOCKS: dict = {}


def causal_block(q: int, device) -> torch.Tensor:
    """[q, q] additive causal mask of the newest block of q queries over its own q keys: 0 where query i sees key j
    (j <= i), +inf above the diagonal (subtracted from scores, added to probabilities before a min); cached per
    (size, device). Shared by the cache's attention and the golden pass."""
    m = _CAUSAL_BLOCKS.get((q, device))
    if m is None:
        m = _CAUSAL_BLOCKS[(q, device)] = torch.full((q, q), float("inf"), device=device).triu(1)
    return m


def visible(ktok: torch.Tensor, qtok: torch.Tensor, own: bool) -> torch.Tensor:
    """[b, h, q, n]: which slots (token indices ``ktok`` [b, h, n]) each query (tokens ``qtok`` [q], held by the
    last q slots) may see: real keys up to its own token. ``own``: a padding query also sees its own slot (chunks:
    its output is never used, but its softmax must not be empty)."""
    n = ktok.shape[-1]
    vis = (ktok[:, :, None, :] <= qtok[None, None, :, None]) & (ktok >= 0)[:, :, None, :]
    if own:
        q = qtok.shape[0]
        vis = vis | (torch.arange(n, device=ktok.device)[None, :] == (n - q + torch.arange(q, device=ktok.device))[:, None])
    return vis


def probabilities(query: torch.Tensor, keys: torch.Tensor, ktok, qtok, padded: bool, own: bool, scaling: float):
    """Post-softmax attention [b, h, g, q, n] (fp32) of ``query`` [b, Hq, q, d] (tokens ``qtok``) to the slots
    ``keys`` [b, h, n, d] (tokens ``ktok`` [b, h, n]; both token tensors are read only when ``padded``).

    Returns the probabilities and the mask of keys a query could not see: ``None`` when ``padded`` is False (then
    the hidden keys are exactly the upper triangle of the newest block, see :func:`causal_block`)."""
    b, hq, q, d = query.shape
    h, n = keys.shape[1], keys.shape[2]
    g = hq // h
    scores = grouped_matmul(scaled(query, scaling), keys.transpose(-1, -2)).view(b, h, g, q, n).float()
    if not padded:
        scores[..., n - q:].sub_(causal_block(q, query.device))  # additive mask: cheaper than masked_fill
        return torch.softmax(scores, -1), None
    hidden = ~visible(ktok, qtok, own)[:, :, None]  # [b, h, 1, q, n]: the same for the group
    probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), -1)
    return probs if own else probs.nan_to_num_(0.0), hidden


def scaled(query: torch.Tensor, scaling: float) -> torch.Tensor:
    """``query * scaling`` written contiguous: the scale goes on the [q, d] queries, not on the [q, n] scores (one
    small multiply instead of a large one), and the product is already laid out for :func:`grouped_matmul`."""
    return (query * scaling).contiguous()


def grouped_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x`` [..., Hq, m, k] (contiguous) times ``y`` [..., h, k, p] for each KV head's g = Hq / h query heads: one
    batched product [B·h, g·m, k] x [B·h, k, p] -> [B·h, g·m, p] (B: the leading dimensions; view it as needed)
    without the broadcast and reshapes of a many-dimensional ``matmul`` (the same kernel: the values are identical).
    ``y`` may be a slice of the cache's slots."""
    k, p = y.shape[-2:]
    rows = y.numel() // (k * p)  # B·h
    return torch.bmm(x.view(rows, -1, k), y.reshape(rows, k, p))


class ChunkMasks:
    """The masks of a bounded cache's forwards. Those that depend only on shapes are made once per shape (the chunk
    path runs on every layer of every chunk): the additive [q, n] mask of fused SDPA without padding, the empty
    placeholder ``attention_mask`` the drivers hand to transformers, and the all-True validity of an unpadded chunk.
    With padding, boolean masks are built from the token indices."""

    def __init__(self):
        self._made: dict = {}

    def _once(self, key: tuple, make) -> torch.Tensor:
        m = self._made.get(key)
        if m is None:
            if len(self._made) > 64:
                self._made.clear()
            m = self._made[key] = make()
        return m

    def chunk(self, q: int, n: int, device, dtype) -> torch.Tensor:
        """Without padding: the additive [q, n] mask in the query's dtype (only the newest [q, q] block is causal)."""
        def make():
            m = torch.zeros(q, n, device=device, dtype=dtype)
            m[:, n - q:] -= causal_block(q, m.device)
            return m
        return self._once(("additive", q, n, device, dtype), make)

    def placeholder(self, b: int, q: int, device) -> torch.Tensor:
        """The empty [b, 1, q, 0] ``attention_mask`` transformers passes through (see BoundedCache.feed)."""
        return self._once(("placeholder", b, q, device), lambda: torch.empty(b, 1, q, 0, dtype=torch.bool, device=device))

    def all_real(self, b: int, q: int, device) -> torch.Tensor:
        """[b, q] all True: the validity of a chunk without padding (read-only)."""
        return self._once(("real", b, q, device), lambda: torch.ones(b, q, dtype=torch.bool, device=device))

    @staticmethod
    def padded_chunk(ktok: torch.Tensor, qtok: torch.Tensor, group: int) -> torch.Tensor:
        """With padding: boolean [b, Hq, q, n] by token index (a padding query sees its own slot)."""
        return visible(ktok, qtok, own=True).repeat_interleave(group, dim=1)

    @staticmethod
    def decoding(ktok: torch.Tensor, group: int) -> torch.Tensor:
        """[b, Hq, 1, n] for one decoding query in the last slot: every real key; a padding query sees itself only
        (its output is never used)."""
        vis = ktok >= 0
        vis[:, :, -1] = True
        return vis.repeat_interleave(group, dim=1)[:, :, None, :]

    @staticmethod
    def static_decoding(ktok: torch.Tensor, group: int) -> torch.Tensor:
        """[b, Hq, 1, capacity] for a static decoding step (foresight.engine.static_step): every real key of the whole
        capacity; the query's own slot already holds its (real) token, empty slots hold -1."""
        return (ktok >= 0).repeat_interleave(group, dim=1)[:, :, None, :]
