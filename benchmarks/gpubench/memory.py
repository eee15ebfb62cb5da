"""The memory rows: ``memory`` (prefill peak above the weights on CUDA, the largest transient tensor on CPU) and ``fit``
(the largest bounded batch whose prefill fits, CUDA only)."""

from __future__ import annotations

import torch

from benchmarks.gpubench.measure import Row, free_memory, generate_with, random_ids, sync, weight_bytes
from benchmarks.gpubench.configs import BenchSettings

GIB = 1024 ** 3


def _prefill_peak(model, s: BenchSettings, policy: str, batch: int) -> int | None:
    """Bytes allocated above what was allocated before (the weights) at the peak of a prefill (and one token) of
    ``batch`` prompts of ``s.memory_prompt`` tokens; None when it does not fit."""
    dev = model.device
    free_memory(dev)
    ids = random_ids(model, batch, s.memory_prompt, s.seed)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        generate_with(model, ids, policy, s, 1)
        sync(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    except torch.OutOfMemoryError:
        peak = None
    del ids
    free_memory(dev)
    return peak


@torch.no_grad()
def _largest_transient(model, s: BenchSettings, policy: str, batch: int) -> dict:
    """CPU: the largest tensor (values) a bounded prefill (and one token) materialises and frees again, counted by
    :class:`benchmarks.opcount.OpCounter` from the smallest tensors up (a tiny shape's are below its default floor),
    against the bound of :func:`benchmarks.opcount.prefill_largest`."""
    from benchmarks import opcount

    ids = random_ids(model, batch, s.memory_prompt, s.seed)
    with opcount.OpCounter(track_from=1) as c:
        res = generate_with(model, ids, policy, s, 1)
        del res
    cfg = model.config
    bound = max(batch * cfg.vocab_size, batch * cfg.num_attention_heads * s.interval * (s.budget + s.interval))
    return {"largest_transient": c.largest_transient, "largest_resident": c.largest_resident, "bound": bound}


def row_memory(row: Row, model, s: BenchSettings) -> None:
    cuda = model.device.type == "cuda"
    for policy in ("h2o", "learned", "full") if cuda else ("h2o", "learned"):
        case = f"{policy} prefill {s.memory_prompt} x {s.memory_batch}"
        if row.late():
            row.skip(case)
        elif cuda:
            peak = _prefill_peak(model, s, policy, s.memory_batch)
            fields = {"oom": True} if peak is None else {"peak_bytes": peak, "peak_gib": round(peak / GIB, 3)}
            row.emit(case, policy=policy, weights_gib=round(weight_bytes(model) / GIB, 3), **fields)
        else:
            row.emit(case, policy=policy, **_largest_transient(model, s, policy, s.memory_batch))


def row_fit(row: Row, model, s: BenchSettings) -> None:
    """Doubles the batch from ``s.memory_batch`` until the H2O prefill runs out of memory (or ``s.fit_cap``)."""
    attempts, batch, largest, stopped = [], s.memory_batch, None, None
    while batch <= s.fit_cap:
        if row.late():
            stopped = "time budget"
            break
        peak = _prefill_peak(model, s, "h2o", batch)
        attempts.append({"batch": batch, "oom": True} if peak is None else {"batch": batch, "peak_gib": round(peak / GIB, 3)})
        if peak is None:
            break
        largest, batch = batch, batch * 2
    first_oom = attempts[-1]["batch"] if attempts and attempts[-1].get("oom") else None
    row.emit(f"h2o prefill {s.memory_prompt}", policy="h2o", largest_batch=largest, first_oom=first_oom, cap=s.fit_cap,
             attempts=attempts, **({"stopped": stopped} if stopped else {}))

