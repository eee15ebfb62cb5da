"""The host's plan of one forward chunk of a :class:`~foresight.engine.cache.bounded.BoundedCache`: how many tokens the
drivers may feed next (:func:`next_chunk`), and, before a chunk's keys arrive (:func:`plan`), what must happen first —
the deferred decoding statistics, the eviction that makes room, growth, the block reset before the first eviction — and
the chunk's token indices, validity and each row's first real token (sinks are counted from it).

Chunks end exactly at eviction points and block starts, so the statistics an eviction reads cover whole chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Chunk(NamedTuple):
    """The forward in progress: its first slot, its size, which tokens are real ``[b, q]`` and their indices ``[q]``."""
    start: int
    size: int
    valid: torch.Tensor
    token: torch.Tensor


def next_chunk(cache, remaining: int) -> int:
    """Largest chunk the drivers may feed next: ends at the next eviction point or block start."""
    if cache.full:
        return remaining
    held = cache.scheduled  # the smallest layer's pairs (the slots in use without per-layer budgets)
    room = cache.capacity - held
    if room <= 0:  # an eviction happens first
        room = cache.capacity - cache.target
    stop = room
    block_start = cache.target - held  # tokens until the block before the first eviction starts
    if 0 < block_start < stop:
        stop = block_start
    return max(1, min(remaining, stop, cache.settings.interval))


def plan(cache, q: int, tok_out: torch.Tensor | None = None, valid_out: torch.Tensor | None = None) -> None:
    """The host's part of a chunk of ``q`` tokens: deferred statistics, eviction, growth, validity, the first real
    tokens; sets ``cache.chunk``. ``tok_out`` [q] / ``valid_out`` [b, q]: buffers a recorded chunk reads them from."""
    first_block = not cache.full and cache.steps == 0 and cache.seen <= cache.target < cache.seen + q
    if cache.stats.n_pending and (q > 1 or first_block):
        cache.replay_deferred()  # deferred statistics go in before a chunk's own (query order) or a block reset
    if not cache.full and cache.scheduled + q > cache.capacity and cache.scheduled > cache.target:
        cache.evict(cache.scheduled - cache.target)
    cache.grow(cache.n + q)
    b, dev = cache.keys.shape[1], cache.keys.device
    valid = cache.pending_valid
    cache.pending_valid = None
    if valid is not None:
        valid = valid.to(dev) if valid_out is None else valid_out.copy_(valid)
        if not cache.padded and not bool(valid.all()):
            cache.padded = True
    if first_block:
        cache.stats.reset_block(cache.n)  # the block before the first eviction starts here
    tok = torch.arange(cache.seen, cache.seen + q, device=dev, out=tok_out)
    cache.chunk_real = valid is None
    _first_real(cache, valid)
    if valid is None:  # every token is real (fed with all_real, or not fed: transformers' own generate)
        valid = cache.masks.all_real(b, q, dev)
    cache.chunk = Chunk(cache.n, q, valid, tok)


def _first_real(cache, valid: torch.Tensor | None) -> None:
    """Each row's first real token index (``valid`` None: every token of the chunk is real)."""
    if cache.all_started:
        return
    if valid is None:
        cache.first_real.masked_fill_(cache.first_real < 0, cache.seen)
        cache.all_started = True
        return
    new_first = (cache.first_real < 0) & valid.any(1)
    cache.first_real = torch.where(new_first, cache.seen + valid.long().argmax(1), cache.first_real)
    cache.all_started = bool((cache.first_real >= 0).all())


def write_tokens(cache) -> None:
    """The chunk's token indices into its slots (-1 for padding)."""
    n, q, valid, tok = cache.chunk
    if cache.chunk_real:
        cache.token.narrow(3, n, q).copy_(tok)
    else:
        tok_b = torch.where(valid, tok.unsqueeze(0), torch.full_like(tok.unsqueeze(0), -1))
        cache.token[:, :, :, n:n + q] = tok_b[None, :, None, :]
    # slots >= n always hold clean statistics (allocation, growth and gathering keep them so)
