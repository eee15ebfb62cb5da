"""The bounded cache's storage, allocated by its first update: the slots (``protected prompt + B + L`` of them, the
largest layer's budget with ``cache.layer_budgets``), the statistics the policy reads, and the rotation tables of the
``ahead`` statistics (:class:`~foresight.engine.cache.bounded.BoundedCache`'s allocation job)."""

from __future__ import annotations

import torch

from foresight.engine import features

from foresight.engine.cache import rope_shift
from foresight.engine.cache.slots import SlotStore
from foresight.engine.attention_shape import AttentionShape
from foresight.engine.cache.attention_stats import SlotStatistics, StatsLayout, accumulations


def _policy_reads(cache):
    """The statistics ``cache``'s policy declares it reads; None (everything) for a full cache or recorded steps."""
    return None if (cache.full or cache.recorder is not None) else getattr(cache.policy, "reads", None)


def accumulated(cache) -> frozenset:
    """What ``cache`` accumulates: what its policy reads; everything for a full cache or when steps are recorded."""
    return accumulations(_policy_reads(cache))


def allocate(cache, key_states: torch.Tensor) -> None:
    """The slots and statistics of ``cache`` for the batch of its first update (``key_states`` [b, h, q, d]); a
    protected prompt longer than the budget is refused or, under ``prompt_overflow=evict``, evicted as usual."""
    b, dev, dt = key_states.shape[0], key_states.device, key_states.dtype
    st = cache.settings
    if st.protect_prompt and cache.prompt_len is None:
        cache.prompt_len = key_states.shape[-2]  # the first forward is the prompt (transformers' generate)
    if not cache.full and st.protect_prompt and cache.prompt_len > st.budget:
        if st.prompt_overflow == "error":
            raise ValueError(f"protect_prompt: the prompt has {cache.prompt_len} tokens, more than the budget "
                             f"B={st.budget}; raise the budget or set cache.prompt_overflow=evict to evict inside "
                             "the prompt")
        cache.settings = st.replace(protect_prompt=False)  # prompt_overflow=evict: the prompt is evicted as usual
    q = key_states.shape[-2]
    cap = max(cache.slot_capacity, q, 1) if not cache.full else max(q, 64)
    nl, h, d = cache.num_layers, cache.kv_heads, cache.head_dim
    cache.slots = SlotStore(nl, b, h, d, cap, dev, dt)
    W = features.QUERY_WINDOW  # decoding queries wait at most until the next eviction
    layout = StatsLayout(AttentionShape(nl, cache.q_heads, h, d), b, cap,
                         pending=W if cache.full else max(cache.settings.interval, W))
    cache.stats = SlotStatistics(accumulated(cache), layout, device=dev, dtype=dt,
                                 newest_kept=cache.full or cache.window >= W, shifts=shift_tables(cache, dev))
    cache.first_real = torch.full((b,), -1, device=dev, dtype=torch.long)  # each row's first real token
    cache.all_started = False  # every row has had its first real token


def shift_tables(cache, device):
    """The rotations of the ``ahead`` statistics (foresight.engine.cache.rope_shift; a few hundred values, made for every rotary
    model so that a fork for another policy has them too), None for a model without RoPE (an error when the policy
    declares them)."""
    try:
        return rope_shift.shift_tables(cache.model_config, features.AHEAD_SHIFTS, device)
    except (ValueError, KeyError, AttributeError):
        reads = _policy_reads(cache)
        if reads is not None and set(reads) & set(features.AHEAD_NAMES):
            raise
        return None


def grow(cache, need: int) -> None:
    """Room for ``need`` slots: a full cache doubles, a bounded one takes what an oversized chunk needs."""
    cap = cache.slots.capacity
    if need <= cap:
        return
    extra = max(need, 2 * cap if cache.full else need) - cap
    cache.slots.grow(extra)
    cache.stats.grow(extra)


def pairs_held(cache) -> float:
    """Pairs held per (sequence, layer, KV head) on average over the heads: the slots in use less the layers' holes
    (``cache.layer_budgets``), the whole heads' store included (their slots' copies count too: it is the memory
    held)."""
    held = cache.n - sum(cache.holes) / cache.num_layers
    if cache.whole is not None:
        held += cache.whole.pairs() * len(cache.whole_heads) / (cache.num_layers * cache.kv_heads)
    return held
