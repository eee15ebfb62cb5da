"""The hand-off between a :class:`~foresight.engine.cache.bounded.BoundedCache` and the registered ``"foresight"`` attention.

transformers calls ``cache.update(keys, values, layer)`` and then the attention function with the keys it got back.
The cache :func:`offer`\\ s that attention call: it records (cache, layer, the key tensor it returned). The attention
function :func:`claim`\\ s it by identity of the key tensor, once, and lets the cache compute the attention (per-head
kept sets, causality by token index). Per thread, so concurrent models in different threads do not mix.
"""

from __future__ import annotations

import threading

_state = threading.local()


def offer(cache, layer: int, key) -> None:
    """The attention call of ``layer`` whose keys are ``key`` is the cache's."""
    _state.offer = (cache, layer, key)


def claim(key):
    """``(cache, layer)`` when ``key`` is the tensor a cache just offered (once); otherwise None."""
    offered = getattr(_state, "offer", None)
    if offered is None or offered[2] is not key:
        return None
    _state.offer = None
    return offered[0], offered[1]
