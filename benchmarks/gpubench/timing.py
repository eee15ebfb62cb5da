"""The timed rows: ``rollout`` and ``group`` (a rollout versus one dense forward of the same tokens), ``golden``
(golden labels versus one dense forward) and ``decode`` (ms/token and tokens/s of a generation, per policy and batch)."""

from __future__ import annotations

import time

import torch

from benchmarks.gpubench.measure import Row, best_pair, dense_fn, free_memory, generate_with, random_ids, rollout_fn, \
    short_ids, sync
from benchmarks.gpubench.configs import BenchSettings

# (policy, decoding step): eager, and the static step recorded once and replayed (a CUDA graph; torch.fx on CPU)
DECODE_CASES = (("full", "eager"), ("h2o", "eager"), ("h2o", "graph"), ("streamingllm", "eager"),
                ("streamingllm", "graph"), ("learned", "eager"), ("learned", "graph"))


def _versus_dense(row: Row, model, s: BenchSettings, policy: str, length: int, batch: int = 1, eviction=None,
                  step: str = "eager") -> None:
    case = f"{policy}{' sample' if eviction is not None else ''}{' graph' if step == 'graph' else ''} S={length} batch={batch}"
    if row.late():
        return row.skip(case)
    eviction = eviction or s.eviction
    ids, short = (random_ids(model, 1, n, s.seed).expand(batch, -1).contiguous()
                  for n in (length, s.budget + 2 * s.interval))
    warm = (dense_fn(model, short), rollout_fn(model, short, policy, eviction, s.seed, step))
    dense, roll = best_pair(dense_fn(model, ids), rollout_fn(model, ids, policy, eviction, s.seed, step), ids.device,
                            s.repeat, warm)
    row.emit(case, policy=policy, step=step, S=length, batch=batch, dense_s=round(dense, 4), rollout_s=round(roll, 4),
             ratio=round(roll / dense, 3))


@torch.no_grad()
def row_rollout(row: Row, model, s: BenchSettings) -> None:
    for length in s.lengths:
        _versus_dense(row, model, s, "h2o", length)
        _versus_dense(row, model, s, "h2o", length, step="graph")  # chunks recorded once, replayed
    for policy in ("streamingllm", "learned"):
        _versus_dense(row, model, s, policy, s.middle)
        _versus_dense(row, model, s, policy, s.middle, step="graph")


@torch.no_grad()
def row_group(row: Row, model, s: BenchSettings) -> None:
    sample = s.eviction.replace(selection="sample", temperature=s.temperature)
    _versus_dense(row, model, s, "learned", s.middle, batch=s.group, eviction=sample)
    _versus_dense(row, model, s, "learned", s.middle, batch=s.group, eviction=sample, step="graph")


@torch.no_grad()
def row_golden(row: Row, model, s: BenchSettings) -> None:
    from foresight.targets.golden import block_pooled_attention

    for length in s.lengths:
        case = f"S={length}"
        if row.late():
            row.skip(case)
            continue
        ids, short = random_ids(model, 1, length, s.seed), short_ids(model, s)
        warm = (dense_fn(model, short), lambda: block_pooled_attention(model, short, s.eviction).future())
        dense, gold = best_pair(dense_fn(model, ids), lambda: block_pooled_attention(model, ids, s.eviction).future(),
                                ids.device, s.repeat, warm)
        row.emit(case, S=length, dense_s=round(dense, 4), golden_s=round(gold, 4), ratio=round(gold / dense, 3))


def _decode_timing(model, ids, policy: str, s: BenchSettings, step: str) -> tuple[float, float]:
    """(seconds to the first decoding step, seconds of ``s.new_tokens`` decoding steps after it): a hook notes the
    first forward call of one token past the prompt. A recorded step (``graph``) is recorded during the timed steps
    (after two eager ones): each generation records its own, so its cost is part of the figure."""
    P, dev, marks = ids.shape[1], ids.device, {}

    def first_step(_module, _args, kwargs):
        if "step" not in marks and kwargs["input_ids"].shape[1] == 1 and int(kwargs["position_ids"][0, 0]) >= P:
            sync(dev)
            marks["step"] = time.perf_counter()

    handle = model.register_forward_pre_hook(first_step, with_kwargs=True)
    try:
        sync(dev)
        t = time.perf_counter()
        generate_with(model, ids, policy, s, s.new_tokens + 1, step)
        sync(dev)
        end = time.perf_counter()
    finally:
        handle.remove()
    return marks["step"] - t, end - marks["step"]


def _decode_once(model, s: BenchSettings, policy: str, batch: int, step: str) -> dict:
    """Warm-up (a short prompt, past the first eviction, and 6 tokens: a recorded step is recorded), then the timed
    generation; ``{"oom": True}`` when it does not fit."""
    n = s.new_tokens
    try:
        generate_with(model, short_ids(model, s, batch), policy, s, 6, step)
        prefill, decode = _decode_timing(model, random_ids(model, batch, s.middle, s.seed), policy, s, step)
        res = {"prefill_s": round(prefill, 4), "decode_s": round(decode, 4), "ms_per_token": round(1000 * decode / n, 3),
               "tokens_per_s": round(batch * n / decode, 1)}
    except torch.OutOfMemoryError:
        res = {"oom": True}
    free_memory(model.device)  # outside the handler: its traceback no longer holds the failed run's tensors
    return res


def row_decode(row: Row, model, s: BenchSettings) -> None:
    for policy, step in DECODE_CASES:
        for batch in s.batches:
            case = f"{policy}{' graph' if step == 'graph' else ''} batch={batch} prompt={s.middle}"
            if row.late():
                row.skip(case)
                continue
            res = _decode_once(model, s, policy, batch, step)
            row.emit(case, policy=policy, step=step, batch=batch, prompt=s.middle, new_tokens=s.new_tokens, **res)
            if res.get("oom"):
                break
