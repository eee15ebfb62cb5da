"""The storage of a bounded cache: keys, values and token indices of every slot, per (layer, sequence, KV head).

One dense tensor holds keys and values of all layers, ``kv[2, layer, batch, kv_head, slot, head_dim]`` (keys after
RoPE), and ``token[layer, batch, kv_head, slot]`` the token index of each pair (its position in the fed sequence,
pads included; ``-1`` for pads and empty slots). Slots stay sorted by time. Stateful policies keep per-slot float
tensors beside them (:meth:`SlotStore.tensor`). Eviction keeps slots by a gather per layer for the pairs (the transient
copy is one layer's, not the whole cache's: at Qwen3-4B's shape with 128 sequences that is 0.5 GB, not 39 GB) and one
per tensor for the rest (:meth:`gather`).
"""

from __future__ import annotations

import torch


class SlotStore:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, device, dtype):
        self.head_dim = head_dim
        self.kv = torch.zeros(2, num_layers, batch, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.keys, self.values = self.kv[0], self.kv[1]
        self.token = torch.full((num_layers, batch, kv_heads, capacity), -1, device=device, dtype=torch.long)
        self.extra: dict[str, torch.Tensor] = {}  # per-slot tensors of stateful policies, kept in step
        self._layer_views()

    def _layer_views(self) -> None:
        """Per-layer views, made once per allocation: indexing a layer on every call dispatches a select and a slice
        per dimension, and the cache's per-layer path runs on every chunk of every layer."""
        layers = range(self.token.shape[0])  # select() views (unbind's may not be written in place under autograd)
        self.layer_keys = [self.keys[i] for i in layers]  # [b, h, capacity, d] each
        self.layer_values = [self.values[i] for i in layers]
        self.layer_token = [self.token[i] for i in layers]  # [b, h, capacity] each
        self.layer_kv = [self.kv[:, i] for i in layers]  # [2, b, h, capacity, d] each

    @property
    def capacity(self) -> int:
        return self.token.shape[-1]

    def tensor(self, name: str, fill: float = 0.0) -> torch.Tensor:
        """A per-slot float tensor ``[nl, b, h, capacity]`` (created on first use) that eviction gathers with the
        kept slots, like the keys."""
        if name not in self.extra:
            self.extra[name] = torch.full(self.token.shape, fill, dtype=torch.float32, device=self.token.device)
        return self.extra[name]

    def grow(self, extra: int) -> None:
        """``extra`` more empty slots."""

        def ext(t, dim, fill):
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)

        self.kv = ext(self.kv, 4, 0)
        self.keys, self.values = self.kv[0], self.kv[1]
        self.token = ext(self.token, 3, -1)
        for name, t in self.extra.items():
            self.extra[name] = ext(t, 3, 0.0)
        self._layer_views()

    def gather(self, order: torch.Tensor, n: int) -> None:
        """Keep the slots ``order`` ([nl, b, h, k], ascending) of the first n; the slots after them become empty."""
        nl, b, h, k = order.shape
        idx_kv = order[:, None, ..., None].expand(nl, 2, b, h, k, self.head_dim).unbind(0)
        for kv, idx in zip(self.layer_kv, idx_kv):  # one layer at a time: the copy is one layer's pairs, not all
            kv.narrow(3, 0, k).copy_(kv.narrow(3, 0, n).gather(3, idx))
        self.token.narrow(3, 0, k).copy_(self.token.narrow(3, 0, n).gather(3, order))
        for t in self.extra.values():
            t.narrow(3, 0, k).copy_(t.narrow(3, 0, n).gather(3, order))
        self.token.narrow(3, k, self.capacity - k).fill_(-1)

    def copy(self, repeat: int = 1) -> "SlotStore":
        """An independent copy, each sequence repeated ``repeat`` times in place (rows ``r0 r0 .. r1 r1 ..``)."""
        out = SlotStore.__new__(SlotStore)
        out.head_dim = self.head_dim
        out.kv = self.kv.repeat_interleave(repeat, dim=2)  # a copy also when repeat == 1
        out.keys, out.values = out.kv[0], out.kv[1]
        out.token = self.token.repeat_interleave(repeat, dim=1)
        out.extra = {k: t.repeat_interleave(repeat, dim=1) for k, t in self.extra.items()}
        out._layer_views()
        return out

    def nbytes(self) -> int:
        """Bytes of the key/value storage."""
        return self.kv.numel() * self.kv.element_size()
