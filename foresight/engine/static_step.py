"""A capturable decoding step for a bounded cache: static shapes, no host syncs, positions on the device.

An eager decoding step (:meth:`BoundedCache.update` / :meth:`~BoundedCache.attend` with one query) attends over
the ``n`` slots in use and writes at a Python-int position, so each step has a new shape and reads host state: fine
eagerly, but a CUDA graph recorded from it would replay the first step's positions forever. In static mode a step

- writes its key/value pair and token index at the slot held by a device tensor (``index_copy_``),
- attends over the whole capacity (``protected prompt + B + L`` slots; empty ones hold token -1 and are masked),
- defers its query for the policy's statistics at a device-side position,

so the same kernels with the same arguments serve every step. The host keeps its own counters (one slot, one
token, one deferred query per step: it never reads them back) and does everything else between steps, outside the
step, with the eager code: the eviction every L tokens, the replay of the deferred queries, the block reset before
the first eviction. That is the eager decoding's own code (:meth:`StaticStep.prepare` runs the cache's plan of a
one-token chunk); only the step's attention also sums over masked empty slots, so its values equal the eager step's
up to float rounding (tested), and tokens and kept sets are the eager ones except where scores tie to rounding.

:class:`StaticDecoder` runs such steps for a model and, with ``capture="cuda"``, records the step once as a CUDA graph
(after warm-up steps) and replays it: one launch per token instead of a few thousand. On a CPU the same step can be
recorded with ``torch.fx`` (``capture="fx"``, :mod:`foresight.engine.recorded`): the recording replays the step's aten
operations with every Python value of the recording baked in, which is what a CUDA graph does, so the tests check on a
CPU that nothing in the step depends on host state that changes between steps.
"""

from __future__ import annotations

import torch

from foresight.engine.recorded import CAPTURES, Recording, cache_storage, on_side_stream
from foresight.engine.cache.slot_attention import ChunkMasks
from foresight.engine.cache_keyword import cache_kwargs

SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal")  # aten ops that wait for the device


class StepPositions:
    """Device-side positions of a step: the slot it writes, its token index, its deferred query's index."""

    def __init__(self, device):
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pending = torch.zeros(1, dtype=torch.long, device=device)

    def set(self, slot: int, pending: int) -> None:
        """Host to device without a sync: fills with their values as kernel arguments (the token index is written
        by the cache's plan of the step, ``BoundedCache.prepare_chunk``)."""
        self.slot.fill_(slot)
        self.pending.fill_(pending)


class StaticStep:
    """The static decoding step of one :class:`~foresight.engine.cache.bounded.BoundedCache` (installed as ``cache.static``; the
    cache hands its one-query updates and attention calls here)."""

    def __init__(self, cache):
        if cache.full or cache.slots is None:
            raise ValueError("static decoding step: needs a bounded cache that was prefilled (a policy, and at least "
                             "one forward of the prompt)")
        if cache.whole_heads:
            raise ValueError("static decoding step: cache.whole_heads is not supported (the whole heads' store grows); "
                             "decode with step='eager'")
        if getattr(cache.policy, "observe", None) is not None:
            raise ValueError(f"static decoding step: policy {getattr(cache.policy, 'name', cache.policy)!r} observes "
                             "every new pair on the host (Policy.observe), which a recorded step cannot do; decode "
                             "it eagerly")
        if cache.slots.capacity != cache.slot_capacity:
            raise ValueError(f"static decoding step: the cache's storage holds {cache.slots.capacity} slots, not its "
                             f"capacity {cache.slot_capacity} (an oversized first forward grew it); prefill in chunks of "
                             "at most the budget (foresight.engine.rollout.forward_chunks)")
        self.cache = cache
        dev = cache.keys.device
        self.at = StepPositions(dev)
        self.defers = bool(cache.needs)
        nl, b, h, _ = cache.token.shape
        self._token_src = self.at.token.view(1, 1, 1, 1).expand(nl, b, h, 1)
        self.real = torch.ones(b, 1, dtype=torch.bool, device=dev)  # a step's validity: decoding tokens are real

    # -------------------------------------------------------------------------- host side, between steps
    def prepare(self) -> None:
        """What an eager step does on the host before its forward (the cache's own plan of a one-token chunk: the
        replay of deferred queries before the first block starts, the eviction when the cache is full, the block
        reset); then the step's positions go to the device."""
        c = self.cache
        c.prepare_chunk(1, self.at.token, self.real)  # the token index into at.token (fed as real: no validity copied)
        self.at.set(c.n, c.stats.n_pending)

    def advance(self) -> None:
        """The host's counters after a step (the cache's end of a chunk, and the deferred query's count)."""
        c = self.cache
        c.finish_prepared()
        if self.defers:
            c.stats.n_pending += 1
            if c.stats.n_pending == c.stats.pending_q.shape[3]:
                c.replay_deferred()

    # ------------------------------------------------------------------------------ the step (recorded)
    def update(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        slots = self.cache.slots
        if layer_idx == 0:
            slots.token.index_copy_(3, self.at.slot, self._token_src)
        keys, values = slots.layer_keys[layer_idx], slots.layer_values[layer_idx]
        keys.index_copy_(2, self.at.slot, key_states)
        values.index_copy_(2, self.at.slot, value_states)
        return keys, values  # the whole capacity

    def attend(self, layer_idx: int, query: torch.Tensor, keys, values, scaling: float) -> torch.Tensor:
        c = self.cache
        mask = ChunkMasks.static_decoding(c.slots.layer_token[layer_idx], c.group)
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)
        if self.defers:
            c.stats.defer_at(layer_idx, query, self.at.pending, self.at.token)
        return out.transpose(1, 2)


class StaticDecoder:
    """Decoding steps of ``model`` over its prefilled :class:`~foresight.engine.cache.bounded.BoundedCache` through the static
    step. ``capture``: ``None`` (run the static step eagerly), or a :class:`~foresight.engine.recorded.Recording`'s kind
    (``"cuda"``: a CUDA graph, ``"fx"``: its CPU stand-in), recorded after ``warmup`` eager steps and replayed. Call
    :meth:`step` with the tokens [b] and their positions [b]; it returns the next logits [b, V] (with a recording, a
    buffer the next step overwrites)."""

    def __init__(self, model, cache, capture: str | None = None, warmup: int = 2):
        if capture not in (None, *CAPTURES):
            raise ValueError(f"StaticDecoder: capture must be None, 'cuda' or 'fx', not {capture!r}")
        if capture == "cuda" and cache.keys.device.type != "cuda":
            raise ValueError("StaticDecoder: capture='cuda' needs the model and cache on a CUDA device")
        self.model, self.cache, self.capture, self.warmup = model, cache, capture, warmup
        self.step_impl = StaticStep(cache)
        b, dev = cache.keys.shape[1], cache.keys.device
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self._kw = cache.feed(self.step_impl.real, all_real=True)
        self.steps = 0
        self.recording: Recording | None = None

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        cache.static = self.step_impl
        try:
            return self.model(input_ids=ids, position_ids=pos, use_cache=True, **cache_kwargs(self.model, cache),
                              **self._kw).logits[:, -1]
        finally:
            cache.static = None

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.step_impl.prepare()
        self.ids.copy_(tokens.view(-1, 1))
        self.pos.copy_(positions.view(-1, 1))
        if self.recording is not None:
            logits = self.recording.replay()
        elif self.capture and self.steps >= self.warmup:
            self.recording = Recording(self._forward, self.capture, lambda: cache_storage(self.cache))
            logits = self.recording.record(self.ids, self.pos)
        else:
            logits = on_side_stream(lambda: self._forward(self.ids, self.pos), self.capture)
        self.step_impl.advance()
        self.steps += 1
        return logits
