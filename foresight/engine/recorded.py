"""Recorded forwards: a step of the model recorded once and replayed for every later step of the same shape.

On CUDA the recording is a CUDA graph: one launch replays the thousands of kernels of a forward (the engine is
launch-bound on a GPU). Elsewhere it is ``torch.fx``'s recording of the same aten operations
(``make_fx``): it replays them with every Python value of the recording baked in, exactly as a CUDA graph does, so a
step that read host state which changes between steps fails the same way on a CPU — the tests' stand-in for a GPU
(it is not faster on a CPU).

A recording holds its inputs (buffers the caller refills before each replay) and its outputs (overwritten by each
replay). What the step writes (the cache's storage) must stay where it was at the recording: :class:`Recording`
checks that before every replay.

:class:`RecordedChunks` runs :func:`foresight.engine.rollout.forward_chunks`' chunks through recordings: chunks whose
host-visible state repeats (after the first eviction every chunk of a rollout has the same size, the same slots in
use and the same layout) are recorded at their second occurrence and replayed afterwards; the eviction between them
runs on the host with the eager code (:meth:`BoundedCache.prepare_chunk`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from foresight.engine import features
from foresight.engine.cache_keyword import cache_kwargs

CAPTURES = ("cuda", "fx")
# how the drivers run a bounded cache's forwards: eager; "static" decoding steps (foresight.engine.static_step) run eagerly;
# "graph": recorded and replayed (decoding steps and repeating chunks)
STEPS = ("eager", "static", "graph")


def set_model_step(model, step: str) -> None:
    """How the drivers (:func:`~foresight.engine.rollout.rollout`, :func:`~foresight.engine.generate.generate`) run this model's
    bounded-cache forwards when a call does not say (the recipe's ``model.step``; set by ``load_model``)."""
    if step not in STEPS:
        raise ValueError(f"model.step must be one of {', '.join(STEPS)}, got {step!r}")
    model._foresight_step = step


def model_step(model, step: str | None = None) -> str:
    """``step`` if given, else the model's (:func:`set_model_step`; eager by default), checked."""
    step = step or getattr(model, "_foresight_step", "eager")
    if step not in STEPS:
        raise ValueError(f"step must be one of {', '.join(STEPS)}, not {step!r}")
    return step


def capture_for(device: torch.device) -> str:
    """The recording a device gets: a CUDA graph on CUDA, torch.fx elsewhere."""
    return "cuda" if device.type == "cuda" else "fx"


class Recording:
    """``fn(*inputs)`` recorded once (:meth:`record`, which also computes this call) and replayed (:meth:`replay`)
    on the same input buffers. ``storage()``: the tensors the step writes, which must not be reallocated."""

    def __init__(self, fn: Callable, capture: str, storage: Callable[[], tuple]):
        if capture not in CAPTURES:
            raise ValueError(f"Recording: capture must be one of {', '.join(CAPTURES)}, not {capture!r}")
        self.fn, self.capture, self.storage = fn, capture, storage
        self.inputs: tuple = ()
        self.out = None
        self._graph = None
        self._module = None
        self._written: tuple = ()

    def record(self, *inputs):
        self.inputs, self._written = inputs, self.storage()
        if self.capture == "cuda":
            self._graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(self._graph):  # recorded, not run
                self.out = self.fn(*inputs)
            self._graph.replay()
            return self.out
        from torch.fx.experimental.proxy_tensor import make_fx

        held = []

        def run(*args):
            out = self.fn(*args)
            held.append(out)
            return out

        self._module = make_fx(run, tracing_mode="real")(*inputs)  # runs the step once, for real
        return held[0]

    def replay(self):
        if not all(a is b for a, b in zip(self._written, self.storage())):
            raise RuntimeError("recorded step: the cache's storage was reallocated after the step was recorded (a "
                               "forward outside the recording grew it); the recording writes to the old one")
        if self._graph is not None:
            self._graph.replay()
            return self.out
        return self._module(*self.inputs)


def on_side_stream(fn: Callable, capture: str):
    """An eager step before a CUDA recording runs on a side stream: lazy initialisations (the BLAS workspace, ...)
    must not happen while recording (torch.cuda.graphs' documented warm-up)."""
    if capture != "cuda":
        return fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return out


def cache_storage(cache) -> tuple:
    """What a forward through a bounded cache writes in place: slots, statistics, kept and deferred queries."""
    st = cache.stats
    return (cache.slots.kv, cache.slots.token, st.buf, st.recent_q, st.pending_q, st.pending_token, st.pending_valid,
            *cache.slots.extra.values())


class RecordedChunks:
    """The chunks of one sequence of forwards through a bounded ``cache``, recorded and replayed where their
    host-visible state repeats. :meth:`forward` takes a chunk's tokens, positions and keyword arguments and returns
    its logits (a recording's output: read them before the next chunk)."""

    def __init__(self, model, cache, capture: str):
        if capture not in CAPTURES:
            raise ValueError(f"RecordedChunks: capture must be one of {', '.join(CAPTURES)}, not {capture!r}")
        self.model, self.cache, self.capture = model, cache, capture
        self.recordings: dict[tuple, Recording] = {}
        self.occurred: set[tuple] = set()
        self._buffers: dict[tuple, tuple] = {}
        self.replays = 0

    def _recordable(self, q: int) -> bool:
        c = self.cache
        return (q > 1 and c.slots is not None and not c.full and c.steps > 0  # one token: a decoding step (static_step)
                and getattr(c.policy, "observe", None) is None and (q >= features.QUERY_WINDOW or "window" not in c.needs))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kw: dict) -> torch.Tensor:
        q = input_ids.shape[1]
        if not self._recordable(q):
            return on_side_stream(lambda: self._model(input_ids, position_ids, kw), self.capture)
        c = self.cache
        ids, pos, tok, valid = self._buffers_for(input_ids, kw)
        c.prepare_chunk(q, tok, valid)
        try:
            key = (q, *c.chunk_layout(), tuple(sorted(kw)))
            ids.copy_(input_ids)
            pos.copy_(position_ids)
            rec = self.recordings.get(key)
            if rec is not None:
                self.replays += 1
                return rec.replay()
            if key in self.occurred:  # the second occurrence: record it
                rec = self.recordings[key] = Recording(lambda i, p: self._model(i, p, kw), self.capture,
                                                       lambda: cache_storage(self.cache))
                return rec.record(ids, pos)
            self.occurred.add(key)
            return on_side_stream(lambda: self._model(ids, pos, kw), self.capture)
        finally:
            c.finish_prepared()

    def _model(self, ids, pos, kw) -> torch.Tensor:
        return self.model(input_ids=ids, position_ids=pos, use_cache=True, **cache_kwargs(self.model, self.cache), **kw).logits

    def _buffers_for(self, input_ids: torch.Tensor, kw: dict) -> tuple:
        b, q = input_ids.shape
        key = (b, q, tuple(sorted(kw)))
        if key not in self._buffers:
            dev = input_ids.device
            self._buffers[key] = (torch.zeros(b, q, dtype=torch.long, device=dev),
                                  torch.zeros(b, q, dtype=torch.long, device=dev),
                                  torch.zeros(q, dtype=torch.long, device=dev),
                                  torch.zeros(b, q, dtype=torch.bool, device=dev))
        return self._buffers[key]
