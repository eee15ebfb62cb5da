"""How a vLLM attention backend lays out one layer's paged KV cache, and the two operations the plugin needs on it:
read the pairs of a request's first n physical positions, and write kept pairs back to its first positions.

A physical position p of a request lives in slot ``block_ids[p // block_size] * block_size + p % block_size``.
Layouts (vLLM 0.32):

* ``cpu``: the CPU backend's ``vec``/``vec16`` kernels: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; inside
  one (block, head), the first ``block_size * head_dim`` values are the keys stored transposed (``[head_dim,
  block_size]``), the rest the values token-major (``[block_size, head_dim]``). (The ``amx`` kernels use a layout of
  their own: refused.)
* ``flash``: the CUDA backends (FlashAttention, FlashInfer's NHD): ``[2, num_blocks, block_size, kv_heads,
  head_dim]``, keys at index 0.
"""

from __future__ import annotations

import torch


def slots_of(block_ids: torch.Tensor, block_size: int, n: int, start: int = 0) -> torch.Tensor:
    """The cache slots [n - start] of physical positions start..n-1 of a request whose blocks are ``block_ids``."""
    pos = torch.arange(start, n, device=block_ids.device)
    return block_ids[pos // block_size].long() * block_size + pos % block_size


class CpuLayout:
    """vLLM's CPU layout (``vec``/``vec16`` kernels: keys transposed within a block)."""

    name = "cpu"

    def __init__(self, block_size: int, head_dim: int):
        self.block_size, self.head_dim = block_size, head_dim

    def _split(self, cache: torch.Tensor):
        nb, h, bs, two_d = cache.shape
        if bs != self.block_size or two_d != 2 * self.head_dim:
            raise ValueError(f"a CPU KV cache of shape {tuple(cache.shape)} is not [blocks, heads, {self.block_size}, "
                             f"{2 * self.head_dim}]")
        flat = cache.view(nb, h, 2 * bs * self.head_dim)
        keys_t = flat[:, :, :bs * self.head_dim].view(nb, h, self.head_dim, bs)
        values = flat[:, :, bs * self.head_dim:].view(nb, h, bs, self.head_dim)
        return keys_t, values

    def gather(self, cache: torch.Tensor, slots: torch.Tensor):
        """Keys and values [kv_heads, n, head_dim] of the cache slots ``slots`` [n]."""
        keys_t, values = self._split(cache)
        blk, off = slots // self.block_size, slots % self.block_size
        return keys_t[blk, :, :, off].transpose(0, 1), values[blk, :, off].transpose(0, 1)

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys and values [kv_heads, n, head_dim] into the cache slots ``slots`` [n]."""
        keys_t, vals = self._split(cache)
        blk, off = slots // self.block_size, slots % self.block_size
        keys_t[blk, :, :, off] = keys.transpose(0, 1).to(cache.dtype)
        vals[blk, :, off] = values.transpose(0, 1).to(cache.dtype)


class FlashLayout:
    """The CUDA backends' layout ``[2, num_blocks, block_size, kv_heads, head_dim]``."""

    name = "flash"

    def __init__(self, block_size: int, head_dim: int):
        self.block_size, self.head_dim = block_size, head_dim

    def gather(self, cache: torch.Tensor, slots: torch.Tensor):
        blk, off = slots // self.block_size, slots % self.block_size
        return cache[0, blk, off].transpose(0, 1), cache[1, blk, off].transpose(0, 1)

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        blk, off = slots // self.block_size, slots % self.block_size
        cache[0, blk, off] = keys.transpose(0, 1).to(cache.dtype)
        cache[1, blk, off] = values.transpose(0, 1).to(cache.dtype)


LAYOUTS = {"cpu": CpuLayout, "flash": FlashLayout}


def layout_for(backend_name: str, isa: str | None, block_size: int, head_dim: int):
    """The layout of an attention backend (vLLM's name, e.g. ``CPU_ATTN``, ``FLASH_ATTN``), or a clear error."""
    name = backend_name.upper()
    if name.startswith("CPU"):
        if isa not in ("vec", "vec16"):
            raise ValueError(f"foresight plugin: the CPU attention kernels {isa!r} store the KV cache in a layout the "
                             "plugin does not read (it reads the 'vec'/'vec16' layout); serve in float32 or on a CPU "
                             "without AMX")
        return CpuLayout(block_size, head_dim)
    if name in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        return FlashLayout(block_size, head_dim)
    raise ValueError(f"foresight plugin: attention backend {backend_name} is not supported (CPU_ATTN, FLASH_ATTN, "
                     "FLASHINFER, TRITON_ATTN are)")


class PagedKV:
    """One request's pairs across the layers' paged caches: read the first n positions densely, write positions back."""

    def __init__(self, layout, caches: list, block_ids: torch.Tensor):
        self.layout, self.caches, self.block_ids = layout, caches, block_ids

    def read(self, n: int) -> torch.Tensor:
        """Keys and values [2, layers, 1, kv_heads, n, head_dim] of physical positions 0..n-1."""
        slots = slots_of(self.block_ids, self.layout.block_size, n)
        first = self.caches[0]
        h = first.shape[1] if isinstance(self.layout, CpuLayout) else first.shape[3]
        kv = torch.empty(2, len(self.caches), 1, h, n, self.layout.head_dim, dtype=first.dtype, device=first.device)
        for i, c in enumerate(self.caches):
            kv[0, i, 0], kv[1, i, 0] = self.layout.gather(c, slots)
        return kv

    def write(self, kv: torch.Tensor, start: int, n: int) -> None:
        """Write positions start..n-1 from dense pairs ``kv`` [2, layers, 1, kv_heads, >= n, head_dim]."""
        if n <= start:
            return
        slots = slots_of(self.block_ids, self.layout.block_size, n, start)
        for i, c in enumerate(self.caches):
            self.layout.scatter(c, slots, kv[0, i, 0, :, start:n], kv[1, i, 0, :, start:n])

    def write_moved(self, kv: torch.Tensor, idx: torch.Tensor, start: int, n: int) -> None:
        """Positions start..n-1 take the pairs ``idx`` [layers, kv_heads, n - start, head_dim] (indices into the slot
        axis, expanded over head_dim) of dense pairs ``kv`` [2, layers, kv_heads, m, head_dim]: an eviction's kept
        pairs, moved to the front without compacting ``kv`` first."""
        if n <= start:
            return
        slots = slots_of(self.block_ids, self.layout.block_size, n, start)
        for i, c in enumerate(self.caches):
            self.layout.scatter(c, slots, kv[0, i].gather(1, idx[i]), kv[1, i].gather(1, idx[i]))
