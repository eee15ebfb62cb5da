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

    def read_blocks(self, cache: torch.Tensor, ids: torch.Tensor):
        """Keys and values [kv_heads, len(ids), block_size, head_dim] (views) of whole blocks ``ids``: one index_select
        of contiguous blocks each (per-slot indexing of the transposed keys costs several times more)."""
        keys_t, values = self._split(cache)
        return keys_t.index_select(0, ids).permute(1, 0, 3, 2), values.index_select(0, ids).transpose(0, 1)

    def write_blocks(self, cache: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite whole blocks ``ids`` with keys and values [kv_heads, len(ids) * block_size, head_dim]."""
        keys_t, vals = self._split(cache)
        h, m = keys.shape[0], len(ids)
        keys_t.index_copy_(0, ids, keys.view(h, m, self.block_size, self.head_dim).permute(1, 0, 3, 2).to(cache.dtype))
        vals.index_copy_(0, ids, values.view(h, m, self.block_size, self.head_dim).transpose(0, 1).to(cache.dtype))


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

    def read_blocks(self, cache: torch.Tensor, ids: torch.Tensor):
        kv = cache.index_select(1, ids).permute(0, 3, 1, 2, 4)
        return kv[0], kv[1]

    def write_blocks(self, cache: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        h, m = keys.shape[0], len(ids)
        for i, x in enumerate((keys, values)):
            cache[i].index_copy_(0, ids, x.view(h, m, self.block_size, self.head_dim).permute(1, 2, 0, 3).to(cache.dtype))


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


def _rows(kv: torch.Tensor):
    """Dense pairs [2, layers, kv_heads, m, head_dim] as rows of head_dim values (one flat view per K/V, the same
    storage), with the row strides of a layer and of a head: picking pairs is then one index_select of whole rows."""
    d = kv.shape[-1]
    if kv.stride(-1) != 1 or kv.stride(-2) != d or any(s % d for s in kv.stride()[:3]):
        kv = kv.contiguous()
    return kv.as_strided((2, kv.stride(0) // d, d), (kv.stride(0), d, 1)), kv.stride(1) // d, kv.stride(2) // d


class PagedKV:
    """One request's pairs across the layers' paged caches: read the first n positions densely, write moved pairs back.
    Both move whole blocks (what vLLM's layouts store contiguously), one copy per layer and K/V."""

    def __init__(self, layout, caches: list, block_ids: torch.Tensor):
        self.layout, self.caches, self.block_ids = layout, caches, block_ids

    def read(self, n: int) -> torch.Tensor:
        """Keys and values [2, layers, 1, kv_heads, n, head_dim] of physical positions 0..n-1."""
        bs = self.layout.block_size
        ids = self.block_ids[:-(-n // bs)]
        first = self.caches[0]
        out = None
        for i, c in enumerate(self.caches):
            keys, values = self.layout.read_blocks(c, ids)  # [kv_heads, blocks, block_size, head_dim] each
            if out is None:
                out = first.new_empty((2, len(self.caches), 1, keys.shape[0], len(ids) * bs, self.layout.head_dim))
            out[0, i, 0].view(keys.shape).copy_(keys)
            out[1, i, 0].view(values.shape).copy_(values)
        return out[..., :n, :]

    def write_moved(self, kv: torch.Tensor, rows: torch.Tensor, start: int, n: int) -> None:
        """Positions start..n-1 take the pairs at slots ``rows`` [layers, kv_heads, n - start] of dense pairs ``kv``
        [2, layers, kv_heads, m, head_dim] (positions 0..m-1 as read): an eviction's kept pairs, moved to the front
        without compacting ``kv`` first. The blocks holding those positions are rewritten whole; their other
        positions below m keep their pairs."""
        if n <= start:
            return
        bs, m = self.layout.block_size, kv.shape[3]
        b0, b1 = start // bs, -(-n // bs)
        nl, h, _ = rows.shape
        before = torch.arange(b0 * bs, start, device=rows.device)
        after = torch.arange(n, b1 * bs, device=rows.device).clamp_(max=m - 1)  # past m: beyond the physical length
        src = torch.cat([before.expand(nl, h, -1), rows, after.expand(nl, h, -1)], dim=2)
        flat, per_layer, per_head = _rows(kv)
        at = (torch.arange(nl, device=src.device)[:, None, None] * per_layer
              + torch.arange(h, device=src.device)[None, :, None] * per_head + src).reshape(-1)
        moved = flat.index_select(1, at).view(2, nl, h, src.shape[2], kv.shape[4])
        ids = self.block_ids[b0:b1]
        for i, c in enumerate(self.caches):
            self.layout.write_blocks(c, ids, moved[0, i], moved[1, i])
