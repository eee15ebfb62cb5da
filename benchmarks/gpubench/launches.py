"""The ``launches`` row: CUDA kernels per chunk per layer of an H2O rollout (``torch.profiler``) versus a plain chunked
forward of the same chunks; on CPU, :mod:`benchmarks.opcount`'s aten operations per chunk per layer instead."""

from __future__ import annotations

import torch

from benchmarks.gpubench.measure import Row, random_ids, rollout_fn
from benchmarks.gpubench.configs import BenchSettings


def _count_device_ops(prof) -> tuple[int, int]:
    """(kernels, copies and fills) the profiler saw on the GPU."""
    from torch.autograd import DeviceType

    results = getattr(prof.profiler, "kineto_results", None)
    events = results.events() if results is not None else prof.events()
    kernels = copies = 0
    for e in events:
        kind = e.device_type() if callable(e.device_type) else e.device_type
        name = e.name() if callable(e.name) else e.name
        if kind == DeviceType.CUDA:
            if name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
    return kernels, copies


def _profiled(fn) -> tuple[int, int]:
    """GPU (kernels, copies) of one call of ``fn``: traced with the CUDA activity alone (the fewest events), and with
    the CPU's too should that see no kernel."""
    from torch.profiler import ProfilerActivity, profile

    for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        with profile(activities=activities) as prof:
            fn()
            torch.cuda.synchronize()
        counts = _count_device_ops(prof)
        if counts[0]:
            break
    return counts


def _chunk_sizes(model, fn) -> list[int]:
    """The query lengths of the forward calls ``fn`` makes."""
    sizes = []
    handle = model.register_forward_pre_hook(lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        fn()
    finally:
        handle.remove()
    return sizes


def _plain_chunks(model, ids, sizes):
    from transformers import DynamicCache

    def run():
        cache, start = DynamicCache(), 0
        for q in sizes:
            model(input_ids=ids[:, start:start + q], cache=cache, use_cache=True)
            start += q
    return run


@torch.no_grad()
def row_launches(row: Row, model, s: BenchSettings) -> None:
    from benchmarks import opcount

    length = s.budget + s.launch_chunks * s.interval
    layers = model.config.num_hidden_layers
    if model.device.type != "cuda":
        c = opcount.ops_per_chunk("h2o", model, S=length, B=s.budget, L=s.interval)
        return row.emit(f"h2o S={length} (aten ops, CPU)", unit="aten ops", S=length, chunks=c["chunks"],
                        per_chunk_layer=c["rollout_per_chunk_layer"], plain_per_chunk_layer=c["plain_per_chunk_layer"],
                        ratio=round(c["rollout_per_chunk_layer"] / c["plain_per_chunk_layer"], 3))
    ids = random_ids(model, 1, length, s.seed)
    roll = rollout_fn(model, ids, "h2o", s.eviction, s.seed)
    sizes = _chunk_sizes(model, roll)  # also the warm-up
    plain = _plain_chunks(model, ids, sizes)
    plain()
    (kernels, copies), (plain_kernels, _) = _profiled(roll), _profiled(plain)
    per = len(sizes) * layers
    row.emit(f"h2o S={length} (CUDA kernels)", unit="kernels", S=length, chunks=len(sizes),
             per_chunk_layer=round(kernels / per, 1), copies_per_chunk_layer=round(copies / per, 1),
             plain_per_chunk_layer=round(plain_kernels / per, 1), ratio=round(kernels / max(plain_kernels, 1), 3))

