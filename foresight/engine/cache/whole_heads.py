"""Whole heads: chosen (layer, KV head) pairs keep every pair while the others are bounded (``cache.whole_heads``).

Where a model's eviction loss sits is uneven across heads: on SmolLM2-135M one KV head of 90 (layer 18, head 2) holds
43% of the loss between the learned scorer and golden at B=128 (``docs/results/smollm2-135m/probe-sft-variants/
layer-swap/``). Keeping such a head's cache whole and giving every other head a slightly smaller budget is the
allocation of DuoAttention's "retrieval heads" (Xiao et al., 2024), for any eviction policy.

How: the bounded cache's slots stay one rectangular array for every head (the whole heads' slots there are evicted like
the others and their attention output is discarded: ``B + L`` wasted pairs per whole head). At the cache's first
eviction — until then its slots hold every pair, so attention over them is already exact — a :class:`WholeHeads` store
copies the chosen heads' pairs from the slots; from then on every new pair of those heads is appended to it, and the
output of their query heads is replaced by attention over the store, causal by token index like the slots'. A fork
(:mod:`foresight.engine.cache.fork`) comes before any eviction, so it starts without a store and makes its own.

Settings: ``"LAYER:HEAD"`` strings (``--set cache.whole_heads=18:2,23:0``), parsed by :func:`parse`.
"""

from __future__ import annotations

import torch

from foresight.config.allocation import parse_whole_heads as parse  # noqa: F401 (re-exported)
from foresight.engine.cache.slot_attention import ChunkMasks


def check_shape(heads: list[tuple[int, int]], num_layers: int, kv_heads: int) -> None:
    """Every whole head exists in the model (``num_layers`` layers of ``kv_heads`` KV heads)."""
    for layer, head in heads:
        if layer >= num_layers or head >= kv_heads:
            raise ValueError(f"cache.whole_heads: {layer}:{head} is not a KV head of this model ({num_layers} layers "
                             f"of {kv_heads} KV heads, counted from 0)")


class WholeHeads:
    """Every pair of the chosen heads: per layer with whole heads, keys and values ``[b, w, T, d]`` and token indices
    ``[b, w, T]`` (``-1`` for padding), ``T`` the tokens fed so far (room grows by doubling)."""

    def __init__(self, heads: list[tuple[int, int]], group: int, device):
        self.group = group
        self.by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            self.by_layer.setdefault(layer, []).append(head)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.token: dict[int, torch.Tensor] = {}
        self.filled = 0  # pairs held per whole head before the chunk in progress
        self.length = 0  # the same with the chunk in progress (what attention sees)
        self._qheads = {layer: torch.tensor([h * group + i for h in hs for i in range(group)], device=device)
                        for layer, hs in self.by_layer.items()}  # each layer's whole heads' query heads

    @classmethod
    def from_slots(cls, cache) -> "WholeHeads":
        """The store at a cache's first eviction: its slots' first ``n`` pairs of the chosen heads (every pair fed)."""
        store = cls(cache.whole_heads, cache.group, cache.keys.device)
        n = cache.n
        for layer, hs in store.by_layer.items():
            idx = torch.tensor(hs, device=cache.keys.device)
            store.keys[layer] = cache.slots.layer_keys[layer].narrow(2, 0, n).index_select(1, idx)
            store.values[layer] = cache.slots.layer_values[layer].narrow(2, 0, n).index_select(1, idx)
            store.token[layer] = cache.slots.layer_token[layer].narrow(2, 0, n).index_select(1, idx)
        store.length = store.filled = n
        return store

    def pairs(self) -> int:
        """Pairs held per whole head."""
        return self.length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values, self.token) for t in d.values())

    def append(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, token: torch.Tensor) -> None:
        """The new pairs of a chunk (``[b, h, q, d]`` for every KV head; ``token`` [b, h, q] their indices) for
        ``layer``, one with whole heads, after the ``filled`` pairs of the chunks before it."""
        hs = self.by_layer[layer]
        q = key_states.shape[2]
        start = self.filled
        self.length = start + q
        for name, new in ((self.keys, key_states), (self.values, value_states), (self.token, token)):
            held = name[layer]
            if held.shape[2] < start + q:  # room doubles: appends stay amortised O(q)
                room = max(start + q, 2 * held.shape[2])
                grown = torch.full((*held.shape[:2], room, *held.shape[3:]), -1 if held.dtype == torch.long else 0,
                                   dtype=held.dtype, device=held.device)
                grown.narrow(2, 0, start).copy_(held.narrow(2, 0, start))
                name[layer] = held = grown
            held.narrow(2, start, q).copy_(new[:, hs])

    def finish_chunk(self) -> None:
        """Every layer has appended the chunk's pairs."""
        self.filled = self.length

    def attend(self, layer: int, query: torch.Tensor, out: torch.Tensor, qtok: torch.Tensor, scaling: float) -> None:
        """Replace ``out`` [b, Hq, q, d] of ``layer``'s whole heads' query heads by their attention (``query`` [b, Hq,
        q, d], tokens ``qtok`` [q]) over every pair held, causal by token index (a padding query sees its own pair)."""
        if layer not in self.by_layer:
            return
        T = self.length
        K, V, ktok = self.keys[layer][:, :, :T], self.values[layer][:, :, :T], self.token[layer][:, :, :T]
        qh = self._qheads[layer]
        mask = ChunkMasks.padded_chunk(ktok, qtok, self.group)  # [b, w*g, q, T], as the slots' with padding
        o = torch.nn.functional.scaled_dot_product_attention(query.index_select(1, qh), K, V, attn_mask=mask,
                                                             scale=scaling, enable_gqa=True)
        out.index_copy_(1, qh, o.to(out.dtype))
