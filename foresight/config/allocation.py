"""How a cache's memory is allocated, as recipes spell it (the ``cache`` section): whole heads as ``"LAYER:HEAD"``
strings (:mod:`foresight.engine.cache.whole_heads`) and per-layer budgets as ``"LAYERS:WEIGHT"`` strings
(:mod:`foresight.engine.cache.layer_budgets`), parsed and checked for form when a recipe is read."""

from __future__ import annotations


def parse_whole_heads(entries) -> list[tuple[int, int]]:
    """``["18:2", ...]`` (or ``(18, 2)`` pairs) as sorted unique (layer, KV head) pairs; a clear error otherwise."""
    heads = []
    for e in entries or ():
        try:
            layer, head = (e.split(":") if isinstance(e, str) else e)
            pair = (int(layer), int(head))
        except (TypeError, ValueError):
            raise ValueError(f"cache.whole_heads: {e!r} is not LAYER:HEAD (e.g. 18:2)") from None
        if min(pair) < 0:
            raise ValueError(f"cache.whole_heads: {e!r} has a negative layer or head")
        if pair in heads:
            raise ValueError(f"cache.whole_heads: {e!r} is listed twice")
        heads.append(pair)
    return sorted(heads)


def parse_layer_budgets(entries) -> list[tuple[str, float]]:
    """``["15-24:2", "*:0.5"]`` as (layers, weight) pairs, checked for form; layers are checked against a model by
    :func:`foresight.engine.cache.layer_budgets.budgets`."""
    out, seen_star = [], False
    for e in entries or ():
        try:
            layers, weight = str(e).rsplit(":", 1)
            w = float(weight)
            if layers != "*":
                layer_range(layers)
        except ValueError:
            raise ValueError(f"cache.layer_budgets: {e!r} is not LAYERS:WEIGHT (e.g. 15-24:2, 18:1.5 or *:0.5)") from None
        if not w > 0 or w != w or w == float("inf"):
            raise ValueError(f"cache.layer_budgets: {e!r} needs a positive weight")
        if layers == "*":
            if seen_star:
                raise ValueError("cache.layer_budgets: '*' is listed twice")
            seen_star = True
        out.append((layers, w))
    return out


def layer_range(spec: str) -> range:
    first, _, last = spec.partition("-")
    lo, hi = int(first), int(last or first)
    if lo < 0 or hi < lo:
        raise ValueError(spec)
    return range(lo, hi + 1)
