"""What the rows' measurements share: :class:`Row` (one JSON line per measurement, skipped past the deadline), timing
(CUDA synchronised, best of a few, two functions alternately), random inputs, the policies by name, a rollout, a dense
pass and a generation as callables, and freeing memory between measurements."""

from __future__ import annotations

import gc
import json
import math
import time

import torch

from foresight.config.eviction import EvictionSettings
from benchmarks.gpubench.configs import BenchSettings


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device) -> float:
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t


def best_pair(fa, fb, dev: torch.device, repeat: int, warm=()) -> tuple[float, float]:
    """Best-of-``repeat`` seconds of two functions, measured alternately (both see the same machine conditions), after
    the warm-up calls ``warm`` (the same functions on a short input: kernels loaded, workspaces allocated)."""
    for fn in warm:
        fn()
    sync(dev)
    ta = tb = math.inf
    for _ in range(repeat):
        ta = min(ta, _timed(fa, dev))
        tb = min(tb, _timed(fb, dev))
    return ta, tb


def free_memory(dev: torch.device) -> None:
    """Release what the last measurement held (after an out-of-memory too: the attention hand-off of a forward that
    failed half-way still references its cache, so a dummy offer replaces it)."""
    from foresight.engine import handoff

    handoff.offer(None, -1, None)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def random_ids(model, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(10, model.config.vocab_size, (batch, length), generator=g)
    return ids.to(model.device)


def short_ids(model, s: BenchSettings, batch: int = 1) -> torch.Tensor:
    """A warm-up input: long enough for two evictions."""
    return random_ids(model, batch, s.budget + 2 * s.interval, s.seed)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _policy(name: str, model):
    """A heuristic by name, or ``learned``: a randomly initialised scorer bank on the model's device (it costs what a
    trained one does); ``full``: None."""
    from foresight.policies import make_policy
    from foresight.scorers.bank import LearnedPolicy, bank_for_model

    return LearnedPolicy(bank_for_model(model).to(model.device)) if name == "learned" else make_policy(name)


def dense_fn(model, ids):
    return lambda: model(input_ids=ids, use_cache=False)


def rollout_fn(model, ids, policy: str, eviction: EvictionSettings, seed: int = 0, step: str = "eager"):
    from foresight.engine.rollout import RolloutOptions, rollout

    pol = _policy(policy, model)  # stateless: the statistics live in each rollout's cache

    def run():
        rollout(model, ids, pol, eviction,
                options=RolloutOptions(torch.Generator(device=ids.device).manual_seed(seed), step=step))
    return run


def generate_with(model, ids, policy: str, s: BenchSettings, new_tokens: int, step: str = "eager"):
    from foresight.engine.generate import GenerateOptions, generate

    pol = _policy(policy, model)
    return generate(model, ids, max_new_tokens=new_tokens, policy=pol, settings=None if pol is None else s.eviction,
                    options=GenerateOptions(torch.Generator(device=ids.device).manual_seed(s.seed), step=step))


class Row:
    """A child's measurements: one JSON line each on stdout; past the deadline, each is recorded as skipped."""

    def __init__(self, name: str, deadline: float):
        self.name, self.deadline = name, deadline

    def late(self) -> bool:
        return time.time() > self.deadline

    def emit(self, case: str, **fields) -> None:
        print(json.dumps({"row": self.name, "case": case, **fields}), flush=True)

    def skip(self, case: str, reason: str = "time budget") -> None:
        self.emit(case, skipped=reason)
