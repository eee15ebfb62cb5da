"""One eviction step of a :class:`~foresight.engine.cache.bounded.BoundedCache`: the policy's view, its scores, the selection, the
gathers that keep the chosen slots.

What the policy sees (:func:`current_view`): keys, values, token indices of the slots in use, the statistics of the
current block (the window sums and ``min`` computed on demand, refused once the cache has moved on) and which slots
are candidates. :func:`evict` scores them, puts padding first, picks the L to drop (:mod:`foresight.engine.selection`:
top-L or the Top-2L sampler), records the step for a ``recorder`` and keeps the rest in time order.
"""

from __future__ import annotations

import torch

from foresight.engine import features

from foresight.engine.cache import layer_budgets
from foresight.engine.selection import choose, kept_slots
from foresight.engine.cache.attention_stats import ALL_ACCUMULATIONS
from foresight.engine.view import EvictionView, candidates


def current_view(cache) -> EvictionView:
    """What the policy sees now (statistics of the current block; the window sums and ``min`` on demand)."""
    cache.replay_deferred()
    n, at = cache.n, (cache.steps, cache.seen)
    missing = "" if cache.needs == ALL_ACCUMULATIONS else (
        f"policy {getattr(cache.policy, 'name', cache.policy)!r} declares reads="
        f"{sorted(cache.policy.reads)} (Policy.reads), and the cache computes only those")

    def check_current():
        if at != (cache.steps, cache.seen):
            raise RuntimeError("this EvictionView is stale: the cache changed since it was made, so its lazily "
                               "computed statistics cannot be computed any more (use view.snapshot() to keep one)")

    tok = cache.token[:, :, :, :n]
    evictable = candidates(tok, cache.window, cache.settings.sinks, cache.first_real, cache.protected_prefix)
    stats = cache.stats.view_stats(n, cache.slots, cache.padded, cache.scaling, check_current, missing,
                                   layers_per_slice=max(1, cache.settings.interval // features.QUERY_WINDOW))
    return EvictionView(cache.keys[:, :, :, :n], cache.values[:, :, :, :n], tok, stats, evictable, n_evict=0,
                        step=cache.steps, seen=cache.seen, prompt_len=cache.prompt_len or 0,
                        generator=cache.generator, slot={k: v[..., :n] for k, v in cache.slots.extra.items()})


@torch.no_grad()
def evict(cache, n_evict: int) -> None:
    """Drop ``n_evict`` pairs per (layer, sequence, KV head) of ``cache``; padding first, then by its policy's
    scores."""
    cache.replay_deferred()
    n = cache.n
    cache.stats.end_block(n)
    view = current_view(cache)
    view.n_evict = n_evict
    tok = view.token
    scores = cache.policy.score(view).float()
    evictable = view.evictable
    if cache.padded:  # padding slots go first (without padding, every slot below n holds a real token)
        pad = (tok == -1) & (torch.arange(n, device=tok.device) >= cache.protected_prefix)  # not the layers' holes
        scores = torch.where(pad, torch.full_like(scores, 1e30), scores)
        evictable = evictable | pad
    # without padding the candidates are the same slots at every eviction of the same size: counted once
    check = cache.padded or (n, n_evict) not in cache._checked
    st = cache.settings
    chosen = None
    if cache.layer_budget is None:
        chosen = choose(scores, evictable, n_evict, st.selection, st.temperature, cache.generator, check=check)
        order = kept_slots(chosen, n)
    else:  # per-layer budgets: each layer drops down to its own budget; slots are freed only above the largest
        drops = [max(0, n - h - cache.protected_prefix - b) for h, b in zip(cache.holes, cache.layer_budget)]
        drop = layer_budgets.ragged_drop(lambda s, e, k: choose(s, e, k, st.selection, st.temperature, cache.generator),
                                         scores, evictable, drops)
        n_evict = max(0, n - cache.slot_capacity + st.interval)  # slots above protected prompt + max B_l
        order, hole = layer_budgets.free_slots(drop, tok == layer_budgets.HOLE, n_evict)
        tok.masked_fill_(hole, layer_budgets.HOLE)  # the slots' own token indices (a view)
        cache.holes = [h + d - n_evict for h, d in zip(cache.holes, drops)]
        cache.padded = True  # attention masks come from token indices from now on
    if not cache.padded:
        cache._checked.add((n, n_evict))
    if cache.recorder is not None:
        cache.recorder({"step": cache.steps, "seen": cache.seen, "token": tok.clone(), "chosen": chosen,
                        "scores": scores, "evictable": evictable, "view": view.snapshot()})
    cache.slots.gather(order, n)
    cache.stats.evicted(order, n)  # and a new block starts
    cache.n = n - n_evict
    cache.steps += 1
