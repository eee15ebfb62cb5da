"""The registered attention function ``"foresight"``.

Registered through transformers' public registries: ``AttentionInterface`` for the attention itself and
``AttentionMaskInterface`` for its mask. The mask registration matters: transformers builds *no* mask at all
for an attention name it does not know, so without it a model running our attention without our cache would
silently lose causality (tested in tests/test_attention.py).

When the keys handed to the attention come from a :class:`~foresight.engine.cache.bounded.BoundedCache`
(:mod:`foresight.engine.handoff` recognises the tensor the cache returned from ``update``), the cache
computes the attention itself (per-head kept sets, causality by token index, padding) and accumulates the statistics
of :mod:`foresight.engine.features`. Otherwise the call is plain SDPA with transformers' mask, so the same model also runs
with a normal ``DynamicCache`` or no cache.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from foresight.engine import handoff
from foresight.engine.cache.slot_attention import causal_block, grouped_matmul, scaled

NAME = "foresight"
_pooling = threading.local()  # the pooler of an active ``pooling`` block


def foresight_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    claimed = handoff.claim(key)
    if claimed is not None:
        cache, layer_idx = claimed
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cache.attend(layer_idx, query, scale), None
    pooler = getattr(_pooling, "pooler", None)
    if pooler is not None and hasattr(pooler, "attend"):  # a tap that computes the attention itself (KVpop target)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return pooler.attend(module.layer_idx, query, key, value, scale), None
    if pooler is not None:
        return _dense_pooled_attention(module, query, key, value, scaling, pooler), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _dense_pooled_attention(module, query, key, value, scaling, pooler):
    """Explicit causal attention of a chunk's queries against all keys so far ([heads, q, S] at a time), handing
    the probabilities to a golden-label pooler (foresight.targets.golden). Rows are right-padded (causal masking keeps real
    queries off the padding; the pooler drops padding queries). Two [q, S]-sized
    tensors per call (scores, then probabilities): the scale goes on the queries and only the newest [q, q] block
    is masked, in place."""
    b, hq, q, k = *query.shape[:3], key.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    _, probs, out = dense_causal(query, key, value, scale)
    changes = getattr(pooler, "output_change", False)
    pooler.add(module.layer_idx, output_change(probs, out, value) if changes else probs.view(b, hq, q, k))
    return out.transpose(1, 2)


def dense_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float):
    """Explicit attention of a chunk's queries [b, Hq, q, d] against all keys so far [b, h, k, d] (the chunk's own q
    the newest, causal among themselves) -> (scores [b, h, g, q, k] fp32 with the causal mask applied, their softmax,
    the output [b, Hq, q, d]). Differentiable (the golden ``loss`` pooling hooks the scores' gradient)."""
    b, hq, q, d = query.shape
    h, k = key.shape[1], key.shape[2]
    scores = grouped_matmul(scaled(query, scale), key.transpose(-1, -2)).view(b, h, hq // h, q, k).float()
    scores[..., k - q:].sub_(causal_block(q, query.device))
    probs = scores.softmax(-1)
    return scores, probs, grouped_matmul(probs.to(value.dtype), value).view(b, hq, q, d)


def output_change(probs: torch.Tensor, out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """How far each query's attention output moves when one key is dropped (the rest renormalised):
    ``p_j · ‖v_j − o‖ / (1 − p_j)`` for probabilities ``probs`` [b, h, g, q, k], outputs ``out`` [b, Hq, q, d] and
    values [b, h, k, d] -> [b, Hq, q, k] fp32 (``o' = (o − p_j v_j) / (1 − p_j)``, so ``o' − o = p_j (o − v_j) / (1 − p_j)``)."""
    b, h, g, q, k = probs.shape
    o = out.float()
    v = value.float()
    cross = grouped_matmul(o.contiguous(), v.transpose(-1, -2)).view(b, h, g, q, k)  # o·v
    dist2 = (o * o).sum(-1).view(b, h, g, q, 1) + (v * v).sum(-1)[:, :, None, None, :] - 2 * cross
    change = probs * dist2.clamp(min=0).sqrt() / (1 - probs).clamp(min=1e-6)
    return change.view(b, h * g, q, k)


@contextlib.contextmanager
def pooling(pooler):
    """Within this block, attention calls without a BoundedCache feed their probabilities to ``pooler`` (a golden
    :class:`~foresight.targets.golden.BlockPooler`), or are computed by it when it has an ``attend`` method (KVpop's
    :class:`~foresight.targets.kvpop.TargetTap`)."""
    _pooling.pooler = pooler
    try:
        yield pooler
    finally:
        _pooling.pooler = None


AttentionInterface.register(NAME, foresight_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_foresight_attention(model):
    """Switch a loaded transformers model to the ``"foresight"`` attention (returns the model)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = NAME
    return model
