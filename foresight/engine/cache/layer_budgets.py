"""Per-layer budgets: layers get unequal shares of the cache while the mean per-layer budget stays B
(``cache.layer_budgets``).

Eviction's loss is uneven across layers: on SmolLM2-135M, layers 15–24 hold 88% of the loss between the learned scorer
and golden at B=128 and 256 (``docs/results/smollm2-135m/probe-sft-variants/layer-swap/``), so giving them more of the
same memory pays (PyramidKV and DuoAttention move memory between layers and heads for the same reason).

Settings: ``"LAYERS:WEIGHT"`` strings, ``LAYERS`` one layer (``18``), a range (``15-24``, both ends included) or ``*``
(every layer not listed otherwise); a layer not listed has weight 1. The weights are relative: layer ``l`` gets
``B_l = nl · B · w_l / Σ w`` pairs, rounded so that the budgets sum to exactly ``nl · B`` (largest remainders), so a
cache with per-layer budgets holds the memory of the uniform B (``--set cache.layer_budgets=15-24:2`` on a 30-layer
model at B=128: layers 15–24 hold 192, the others 96).

How (:class:`~foresight.engine.cache.bounded.BoundedCache`): evictions come every L tokens from the smallest budget's first
(``min B_l + L`` tokens, plus a protected prompt), and at each one every layer holding more than its ``B_l`` pairs drops
down to ``B_l`` by the policy's scores (L pairs once it is past its own first eviction), so layer ``l`` never holds
more than ``B_l + L``. The slots stay one rectangular array of ``max B_l + L``: a dropped pair below that becomes a
*hole* (token index :data:`HOLE`: no query sees it, it is never a candidate), and slots are freed (holes first, in
slot order) only above ``max B_l``. From the largest layer's first eviction on, layer ``l`` carries ``max B − B_l``
holes per head: wasted storage that a paged cache would not allocate. The memory the cache reports (``mean_held``, the
evaluation's *mean cache*) counts the pairs held, not the holes: at most the uniform B's, equal once every layer has
evicted.
"""

from __future__ import annotations

import torch

from foresight.config.allocation import layer_range, parse_layer_budgets as parse  # noqa: F401 (parse: re-exported)

HOLE = -2  # the token index of a hole (padding and empty slots hold -1: both are invisible, only padding is evicted)


def weights(entries, num_layers: int) -> list[float]:
    """Each layer's weight (1 unless listed; ``*``: every layer not listed by number)."""
    w: list[float | None] = [None] * num_layers
    star = 1.0
    for layers, weight in parse(entries):
        if layers == "*":
            star = weight
            continue
        for layer in layer_range(layers):
            if layer >= num_layers:
                raise ValueError(f"cache.layer_budgets: layer {layer} ({layers}:{weight:g}) is not a layer of this model "
                                 f"({num_layers} layers, counted from 0)")
            if w[layer] is not None:
                raise ValueError(f"cache.layer_budgets: layer {layer} is listed twice")
            w[layer] = weight
    return [star if x is None else x for x in w]


def budgets(entries, budget: int, num_layers: int) -> list[int]:
    """Each layer's budget: shares of ``num_layers · budget`` by weight, rounded by largest remainders (they sum to
    exactly ``num_layers · budget``)."""
    w = weights(entries, num_layers)
    total = num_layers * budget
    exact = [total * x / sum(w) for x in w]
    out = [int(x) for x in exact]
    for i in sorted(range(num_layers), key=lambda i: (out[i] - exact[i], i))[:total - sum(out)]:
        out[i] += 1
    return out


def check(per_layer: list[int], interval: int, window: int, sinks: int) -> None:
    """Every layer's budget leaves room for an eviction (the uniform budget's own rules, per layer)."""
    for layer, b in enumerate(per_layer):
        if b <= interval or b < sinks + window:
            raise ValueError(f"cache.layer_budgets: layer {layer} gets B={b}, which must exceed the interval L={interval} "
                             f"and be at least sinks + window = {sinks} + {window}: raise the budget or flatten the weights")


def for_cache(settings, num_layers: int, window: int, recorder=None) -> list[int] | None:
    """Each layer's budget for a bounded cache of ``settings`` (:class:`~foresight.config.eviction.EvictionSettings`), checked;
    None when every layer gets the same. Refused with a recorder: recorded eviction steps have one drop count."""
    if not settings.layer_budgets:
        return None
    per_layer = budgets(settings.layer_budgets, settings.budget, num_layers)
    check(per_layer, settings.interval, window, settings.sinks)
    if len(set(per_layer)) == 1:
        return None
    if recorder is not None:
        raise ValueError("cache.layer_budgets: recorded eviction steps (golden labels, GRPO, eval.recall) are not "
                         "supported with per-layer budgets (the first eviction drops more pairs in some layers); "
                         "set eval.recall=false, or train without them")
    return per_layer


def ragged_drop(choose, scores: torch.Tensor, evictable: torch.Tensor, drops: list[int]) -> torch.Tensor:
    """[nl, b, h, n] bool: the pairs each layer gives up, ``drops[l]`` per row of layer ``l``, chosen by
    ``choose(scores, evictable, k)`` (the cache's selection) once per distinct count."""
    nl, n = scores.shape[0], scores.shape[-1]
    drop = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    for k in sorted(set(drops) - {0}):
        layers = torch.tensor([i for i in range(nl) if drops[i] == k], device=scores.device)
        chosen = choose(scores.index_select(0, layers), evictable.index_select(0, layers), k)
        part = torch.zeros((len(layers), *scores.shape[1:-1], n), dtype=torch.bool, device=scores.device)
        drop.index_copy_(0, layers, part.scatter_(-1, chosen, True))
    return drop


def free_slots(drop: torch.Tensor, holes: torch.Tensor, n_free: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each row's holes and dropped pairs (``holes``, ``drop`` [..., n]), the first ``n_free`` in slot order leave
    the storage, the other dropped pairs become holes: (the kept slots' order [..., n - n_free] for the gather, the new
    holes' mask [..., n]). Every row has at least ``n_free`` of them (the budgets' invariant)."""
    gone = drop | holes
    freed = gone & (gone.cumsum(-1) <= n_free)
    n = drop.shape[-1]
    order = torch.sort(freed, dim=-1, stable=True).indices[..., :n - n_free]
    return order, drop & ~freed
