"""The attention of a :class:`~foresight.engine.cache.bounded.BoundedCache`'s new queries against its slots, and the statistics
the policy reads, accumulated on the way.

A chunk (q > 1) computes the probabilities explicitly when a statistic needs them (fused SDPA otherwise: the two round
differently, which is why a shared prefix is only forked for a policy on the same path, :mod:`foresight.engine.cache.fork`).
A decoding step (q = 1) runs fused SDPA and defers its query; the deferred queries are replayed in one batched pass
when the statistics are next needed (before an eviction, a chunk or a block reset).
"""

from __future__ import annotations

import torch

from foresight.engine.cache.slot_attention import ChunkMasks, grouped_matmul, probabilities
from foresight.engine.cache.attention_stats import PROB_ACCUMULATIONS


def attend(cache, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of the new queries [b, Hq, q, d] (after RoPE) against layer ``layer_idx``'s slots; returns
    [b, q, Hq, d] like transformers' attention functions."""
    cache.scaling = scaling
    at, K, V = cache.layer_kv
    if at != layer_idx:
        raise RuntimeError(f"BoundedCache: attention of layer {layer_idx} without its update")
    if cache.static is not None:
        return cache.static.attend(layer_idx, query, K, V, scaling)
    n_old, q, valid, qtok = cache.chunk
    n = n_old + q
    # token indices of the slots: masks are built from them only once padding was fed
    ktok = cache.slots.layer_token[layer_idx].narrow(2, 0, n) if (cache.padded or q == 1) else None  # [b, h, n]
    last = layer_idx == cache.num_layers - 1
    if q == 1 and not cache.full:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, K, V, attn_mask=ChunkMasks.decoding(ktok, cache.group), scale=scaling, enable_gqa=True)
        if cache.whole is not None:
            cache.whole.attend(layer_idx, query, out, qtok, scaling)
        full = cache.needs and cache.stats.defer(layer_idx, query, cache.seen, valid)
        if last and not cache.prepared:
            cache.finish_chunk()
            if full:
                cache.replay_deferred()
        return out.transpose(1, 2)
    if cache.needs & PROB_ACCUMULATIONS:
        probs, hidden = probabilities(query, K, ktok, qtok, cache.padded, True, scaling)
        # the g query heads of a KV head share its keys: one [g*q, n] x [n, d] product per KV head, no broadcast
        out = grouped_matmul(probs.to(V.dtype), V).view(query.shape)
        cache.stats.accumulate(layer_idx, probs, hidden, valid)  # last: it may overwrite the probabilities
    else:  # no statistic needs the probabilities: fused attention
        mask = ChunkMasks.padded_chunk(ktok, qtok, cache.group) if cache.padded else \
            cache.masks.chunk(q, n, query.device, cache.keys.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(query, K, V, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)
    if cache.whole is not None:
        cache.whole.attend(layer_idx, query, out, qtok, scaling)
    if "window" in cache.needs:
        cache.stats.remember_queries(layer_idx, query, qtok, valid)
    if last and not cache.prepared:  # a prepared chunk is finished by its caller (a replay runs no Python)
        cache.finish_chunk()
    return out.transpose(1, 2)
