"""A bounded cache built from a scorer checkpoint that plain ``model.generate(...)`` accepts.

    from foresight.integrations.hf import ForesightCache
    cache = ForesightCache.from_pretrained("runs/tiny-qwen3/grpo", model, budget=320, interval=64)
    out = model.generate(input_ids, cache=cache, max_new_tokens=1100)

``from_pretrained`` checks the checkpoint against the model (layers, heads, head dim; a mismatch is a clear
error), switches the model to the ``"foresight"`` attention (plain SDPA whenever this cache is not in use), and
evicts deterministically (top-L) unless ``selection="sample"`` asks for the paper's Top-2L sampler.
Works for any model whose attention goes through transformers' cache and attention registries (Qwen3,
Qwen2, Llama, ...). Note: transformers' ``generate`` prefills the whole prompt in one forward pass, so a
prompt longer than the budget is held in full until the first decoding step evicts it down to B; use
:func:`foresight.engine.generate.generate` for chunked prefill with bounded peak memory. transformers releases
from before the ``cache`` keyword take ``past_key_values=cache`` instead (they refuse ``cache=`` as an unused
model keyword).
"""

from __future__ import annotations

from pathlib import Path

import torch

from foresight.engine.attention import use_foresight_attention
from foresight.engine.cache.bounded import BoundedCache
from foresight.scorers.checkpoint import load_scorer, policy_from_checkpoint
from foresight.config.eviction import EvictionSettings


class ForesightCache(BoundedCache):
    """A :class:`~foresight.engine.cache.bounded.BoundedCache` driven by trained scorers (ForesightKV, or KVpop with its own
    sinks and window)."""

    @classmethod
    def from_pretrained(cls, scorer_dir: str | Path, model, settings: EvictionSettings | None = None,
                        seed: int | None = None, **changes) -> "ForesightCache":
        """``settings``: default the checkpoint's B, L and sinks with top-L selection; ``changes``: fields of
        :class:`~foresight.config.eviction.EvictionSettings` to override (``budget=320, interval=64, selection="sample"``,
        ...). ``seed``: seeds the sampler."""
        bank, cfg = load_scorer(scorer_dir, model, device=next(model.parameters()).device)
        use_foresight_attention(model)
        if settings is None:
            settings = EvictionSettings(budget=cfg["budget"], interval=cfg["interval"], sinks=cfg.get("sinks", 0))
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed) if seed is not None else None
        return cls(model.config, policy_from_checkpoint(bank, cfg), settings.replace(**changes), generator=gen)
