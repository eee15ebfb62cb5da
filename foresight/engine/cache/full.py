"""The full cache for generation: transformers' ``Cache`` interface over key/value buffers allocated once, whose
attention reads only the filled part.

transformers offers two full caches and each costs a decoding step something the other avoids: ``DynamicCache``
concatenates every layer's keys and values at every token (a copy of the whole cache per step), ``StaticCache``
allocates once but hands the attention all ``max_cache_len`` slots at every step, filled or not (and a mask as long),
so the first token of a 1,024-token continuation costs what the last does. :class:`PreallocatedCache` writes each new
pair in place, like ``StaticCache``, and hands the attention views of the filled prefix, like ``DynamicCache`` (whose
mask sizes and sequence length it keeps): the same keys in the same order reach the same SDPA call, so its values are
``DynamicCache``'s bit for bit. Measured (README, after ``make bench``): 64 sampled SmolLM2 rows of 1,024 tokens on 2
CPU cores in 225 s against 329 s with ``StaticCache``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from foresight.engine.attention_shape import AttentionShape


class PreallocatedLayer(DynamicLayer):
    """One layer: buffers ``[b, h, capacity, d]`` allocated at the first update; ``keys``/``values`` are views of
    their filled prefix. A method of ``DynamicLayer`` that replaces ``keys`` with a new tensor (beam reordering, batch
    selection) is honoured: the next update copies them into fresh buffers."""

    def __init__(self, capacity: int):
        super().__init__()
        if capacity <= 0:
            raise ValueError(f"a preallocated cache needs a positive capacity, got {capacity}")
        self.capacity = capacity
        self._k = self._v = None

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        b, h, n, _ = keys.shape
        self._k = keys.new_empty(b, h, self.capacity, keys.shape[-1])
        self._v = values.new_empty(b, h, self.capacity, values.shape[-1])
        self._k[:, :, :n].copy_(keys)
        self._v[:, :, :n].copy_(values)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._allocate(key_states[:, :, :0], value_states[:, :, :0])
        self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.keys.data_ptr() != self._k.data_ptr() or self.keys.shape[0] != self._k.shape[0]:
            self._allocate(self.keys, self.values)  # keys replaced by a DynamicLayer method: adopt them
        n, q = self.keys.shape[-2], key_states.shape[-2]
        if n + q > self.capacity:
            raise ValueError(f"the preallocated full cache holds {self.capacity} tokens; {n + q} were fed")
        self._k[:, :, n:n + q].copy_(key_states)
        self._v[:, :, n:n + q].copy_(value_states)
        self.keys, self.values = self._k[:, :, :n + q], self._v[:, :, :n + q]
        return self.keys, self.values

    def get_max_length(self) -> int:
        return self.capacity


class PreallocatedCache(Cache):
    """The full cache of ``capacity`` tokens per row for ``model_config``'s layers (see the module's doc)."""

    def __init__(self, model_config, capacity: int):
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(AttentionShape.of(model_config).num_layers)])
