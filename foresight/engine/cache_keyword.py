"""The forward keyword that hands a transformers model its cache: ``cache`` in the releases that renamed it,
``past_key_values`` before. A model given the other name takes it as an unknown keyword and silently runs without
a cache (every decoding step would see only its own token), so every forward of the engine asks here."""

from __future__ import annotations

import functools
import inspect


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for ``model``'s forward."""
    return {_cache_keyword(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls) -> str:
    params = inspect.signature(cls.forward).parameters
    return "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"
