"""The per-layer facade a :class:`~foresight.engine.cache.bounded.BoundedCache` shows transformers: its generic code
(``is_sliding``, ``get_seq_length``, per-layer ``update``) sees a normal cache layer, while the storage lives in the
parent cache."""

from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin


class LayerHandle(CacheLayerMixin):
    """A per-layer facade so transformers' generic code (is_sliding, get_seq_length...) sees a normal cache."""

    is_sliding = False
    is_compileable = False

    def __init__(self, parent, idx: int):  # parent: the BoundedCache
        super().__init__()
        self.parent, self.idx = parent, idx

    def lazy_initialization(self, key_states, value_states):  # storage lives in the parent
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.parent.update(key_states, value_states, self.idx)

    def get_mask_sizes(self, query_length: int):
        return self.parent.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.parent.seen

    def get_max_length(self) -> int:
        return -1
