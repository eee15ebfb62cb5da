"""How many traces a GRPO step needs: the gradient noise scale of GRPO's objective at a scorer (usually the SFT start).

A GRPO step averages one gradient per trace: a training trace drawn uniformly (with replacement), a group of G
trajectories rolled out on it, their group-normalised advantages. Each draw's gradient ``g_i`` is the true gradient
``G`` plus noise of covariance ``Σ``; a step over ``n`` draws has signal ``|G|²`` and noise ``tr(Σ)/n``. The *noise
scale* ``B_noise = tr(Σ) / |G|²`` (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training") is the number
of draws per step at which the two are equal, and over a whole run the update's signal-to-noise grows with the draws
it has seen in all, ~ (steps × traces per step) / B_noise. This measures it from the first GRPO step's objective at the
start (ratio 1, no clip, no KL gradient) on ``n`` draws (``--traces-n``; a trace drawn twice gets two rollouts):

* ``signal_sq``: an unbiased estimate of ``|G|²`` (the mean of ``g_i · g_j`` over pairs of different draws) with a 95%
  bootstrap interval over the draws; an interval reaching 0 means the n draws together show no direction above
  their noise (then ``b_noise`` is a lower bound at best).
* ``trace_cov``: ``tr(Σ̂)``, one draw's noise; ``b_noise``: their ratio (None when the signal estimate is ≤ 0).
* ``split_half_cosine``: the cosine between the mean gradients of two random halves of the draws (mean over 200
  splits): near 0 when two halves do not agree on a direction, near 1 when half the draws already fix it.
* ``adam``: the same for gradients divided per coordinate by their root mean square over the draws (a stand-in for
  Adam's ``√v``, which is what GRPO's optimiser steps by); ``by_tensor``: per parameter tensor of the scorers.
* the **permuted control** (each group's rewards shuffled among its trajectories: advantages of the same sizes
  without the information of which trajectory earned them), whose true gradient is 0: its signal interval should
  reach 0 and its split-half cosine stay near 0, which tells the real figures from chance.
* ``flat_groups``: draws whose G rewards are all equal (a zero gradient).

    python -m studies.grpo_noise --recipe recipes/smollm2-135m-realbench.yaml --traces runs/rb/traces \\
        --init scorers/smollm2-135m/sft-w256-gap --traces-n 32 --out runs/grpo-noise

Each draw's two gradients are written to ``OUT/grads/`` as they finish (atomically: a killed run resumes from the
draws it finished; a run with more ``--traces-n`` adds to them); ``OUT/summary.json`` holds the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from foresight.runtime import atomic
from foresight.scorers.checkpoint import load_scorer
from foresight.config.recipe import load_recipe
from foresight.training.grpo.objective import group_advantage, step_objective, trajectory_reward
from foresight.training.grpo.rollout import GroupSampling, group_rollout
from foresight.training.grpo.heldout import first_scored_token
from foresight.engine.models import load_model
from foresight.evaluation.paired import resamples
from foresight.data.trace_data import load_traces
from foresight.data.stage_inputs import check_traces_model, split_traces

SPLITS = 200  # random half-splits averaged in the split-half cosine


def flat_grad(bank) -> torch.Tensor:
    """The scorer bank's gradient as one float64 vector (zeros for parameters without one)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
                      for p in bank.parameters()])


def objective_gradient(bank, ref, steps: list[dict], adv: torch.Tensor, grpo_cfg) -> torch.Tensor:
    """The gradient of one trace's GRPO objective (the mean over its eviction steps, as :mod:`foresight.training.grpo.stage` takes
    it) with the advantages ``adv`` [G]."""
    bank.zero_grad(set_to_none=True)
    loss = torch.stack([step_objective(bank, ref, s, adv, grpo_cfg)[0] for s in steps]).mean()
    loss.backward()
    return flat_grad(bank)


def trace_gradients(model, bank, ref, row: dict, recipe, seed: int) -> dict:
    """One training trace: a group rollout by ``bank`` (Top-2L at GRPO's temperature), its rewards and advantages, and
    the objective's gradient with those advantages and with the group's rewards permuted (the null control)."""
    cfg, settings = recipe.grpo, recipe.cache
    dev = next(model.parameters()).device
    ids = torch.tensor([row["input_ids"]], device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    bank.eval()
    res, steps, overlap = group_rollout(model, bank, ids, GroupSampling.from_grpo(cfg), settings, gen, row["prompt_len"])
    if not steps:
        raise ValueError(f"a trace of {ids.shape[1]} tokens has no eviction at B={settings.budget}, L={settings.interval}")
    r = trajectory_reward(res.token_loss, torch.tensor(row["token_loss"], device=dev),
                          torch.tensor(row["token_entropy"], device=dev), first_scored_token(settings, row["prompt_len"]),
                          cfg)
    perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(seed)).to(r.device)
    bank.train()
    real = objective_gradient(bank, ref, steps, group_advantage(r), cfg)
    permuted = objective_gradient(bank, ref, steps, group_advantage(r[perm]), cfg)
    return {"real": real.float(), "permuted": permuted.float(), "reward": r.tolist(), "overlap": overlap,
            "flat": bool(r.std() < 1e-8)}


def noise_scale(gram: np.ndarray, seed: int = 0) -> dict:
    """The noise-scale figures from the Gram matrix ``gram[i, j] = g_i · g_j`` of n ≥ 4 per-trace gradients (see the
    module docstring). Every figure is a function of the Gram matrix, so the bootstrap resamples its rows and columns."""
    n = gram.shape[0]
    if n < 4:
        raise ValueError(f"the noise scale needs at least 4 traces, got {n}")

    def signal(idx: np.ndarray) -> float:
        # |ḡ|² − tr(Σ̂)/n is the mean of g_i · g_j over the pairs of two different traces (E = |G|²); a resample's
        # pairs of one trace drawn twice are left out, or its noise would count as signal
        other = idx[:, None] != idx[None, :]
        return float(gram[np.ix_(idx, idx)][other].mean()) if other.any() else float("nan")

    mean_sq = gram.sum() / n ** 2  # |ḡ|²
    cov = (np.trace(gram) - n * mean_sq) / (n - 1)  # tr(Σ̂), unbiased
    sig = signal(np.arange(n))
    boot = np.array([signal(idx) for idx in resamples(n, seed)])
    boot = boot[np.isfinite(boot)]  # a resample of one trace drawn n times has no pair
    rng = np.random.default_rng(seed)
    cosines = []
    for _ in range(SPLITS):
        order = rng.permutation(n)
        a, b = order[: n // 2], order[n // 2: 2 * (n // 2)]
        ab = gram[np.ix_(a, b)].sum()
        aa, bb = gram[np.ix_(a, a)].sum(), gram[np.ix_(b, b)].sum()
        cosines.append(ab / np.sqrt(max(aa * bb, 1e-300)))
    lo, hi = np.percentile(boot, [2.5, 97.5])  # not percentile_interval: it rounds to 5 decimals, and |G|² can be 1e-6
    return {"n": n, "signal_sq": sig, "signal_sq_ci": [float(lo), float(hi)], "trace_cov": float(cov),
            "b_noise": float(cov / sig) if sig > 0 else None, "split_half_cosine": float(np.mean(cosines)),
            "mean_grad_norm": float(np.sqrt(max(mean_sq, 0.0))),
            "trace_grad_norm": float(np.sqrt(np.trace(gram) / n))}


GRPO_FIELDS = ("group", "temperature", "ratio", "eta", "low_entropy_share", "low_entropy_below", "normalise", "clip_eps",
               "beta", "val_traces")


def same_settings(out: Path, settings: dict) -> None:
    """Refuse to resume ``out`` under other settings (its stored gradients would be another measurement's)."""
    f = out / "settings.json"
    settings = json.loads(json.dumps(settings))
    if f.exists():
        saved = json.loads(f.read_text())
        diffs = [k for k in sorted(set(saved) | set(settings)) if saved.get(k) != settings.get(k)]
        if diffs:
            raise ValueError(f"{out} holds gradients measured under other settings ({', '.join(diffs)} differ); "
                             f"use another --out")
    else:
        atomic.write_json(f, settings, indent=1)


def gram_of(m: torch.Tensor) -> np.ndarray:
    """``m`` [n, d] (one gradient per row) -> its Gram matrix ``m @ m.T`` [n, n]."""
    return (m @ m.T).numpy()


def figures(vectors: list[torch.Tensor], tensors: list[tuple[str, int]], seed: int) -> dict:
    """:func:`noise_scale` of the draws' gradients, of their Adam-scaled version, and per parameter tensor."""
    m = torch.stack([v.double() for v in vectors])
    scaled = m / ((m ** 2).mean(0).sqrt() + 1e-30)
    out = {**noise_scale(gram_of(m), seed), "adam": noise_scale(gram_of(scaled), seed), "by_tensor": {}}
    lo = 0
    for name, size in tensors:
        out["by_tensor"][name] = noise_scale(gram_of(m[:, lo:lo + size]), seed)
        lo += size
    return out


def run(recipe, traces_dir: Path, init: Path, out: Path, n: int, seed: int = 0, log=print) -> dict:
    """The noise scale from ``n`` draws (training traces drawn with ``seed``, each draw's rollout seeded by its number),
    resuming from ``OUT/grads``; returns (and writes) the summary."""
    if n < 4:
        raise ValueError(f"--traces-n must be at least 4, got {n}")
    out = Path(out)
    (out / "grads").mkdir(parents=True, exist_ok=True)
    same_settings(out, {"init": str(init), "traces": str(traces_dir), "seed": seed, "cache": vars(recipe.cache),
                        "grpo": {k: getattr(recipe.grpo, k) for k in GRPO_FIELDS}})
    model, _ = load_model(recipe.model)
    bank, init_cfg = load_scorer(init, model)
    bank.requires_grad_(True)
    ref = copy.deepcopy(bank).eval().requires_grad_(False)
    ds = load_traces(traces_dir)
    check_traces_model(ds, traces_dir, recipe.model, model)
    train_idx, _ = split_traces(len(ds), recipe.grpo.val_traces)
    if not train_idx:
        raise ValueError(f"{traces_dir} holds no training traces (all {len(ds)} are GRPO's validation traces)")
    # draws as a GRPO step makes them: a uniform training trace (with replacement) and a fresh group rollout, so the
    # n per-draw gradients are independent samples of what a step averages (and n may exceed the traces)
    rng = random.Random(seed)
    picked = [rng.choice(train_idx) for _ in range(n)]
    done, t0 = [], time.time()
    tensors = [(name, p.numel()) for name, p in bank.named_parameters()]  # flat_grad's order
    for k, i in enumerate(picked):
        f = out / "grads" / f"draw-{k:05d}-trace-{i:05d}.pt"
        if not f.exists():
            atomic.torch_save(trace_gradients(model, bank, ref, ds[i], recipe, seed * 1_000_003 + k), f)
            log(f"[grpo-noise] draw {k + 1}/{n} ({time.time() - t0:.0f} s)")
        done.append(torch.load(f, weights_only=False))
    summary = {"init": str(init), "traces": str(traces_dir), "trace_indices": picked, "seed": seed,
               "budget": recipe.cache.budget, "interval": recipe.cache.interval, "group": recipe.grpo.group,
               "temperature": recipe.grpo.temperature, "eta": recipe.grpo.eta, "ratio": recipe.grpo.ratio,
               "flat_groups": sum(d["flat"] for d in done) / n,
               "reward_std_mean": float(np.mean([np.std(d["reward"], ddof=1) for d in done])),
               "group_overlap": float(np.mean([d["overlap"] for d in done])),
               "real": figures([d["real"] for d in done], tensors, seed),
               "permuted": figures([d["permuted"] for d in done], tensors, seed),
               "init_budget": init_cfg.get("budget")}
    atomic.write_json(out / "summary.json", summary, indent=1)
    return summary


def noise_table(s: dict) -> str:
    rows = ["| advantages | gradient | signal |G|² [95% CI] | one draw's noise tr(Σ) | B_noise (draws) | split-half cosine |",
            "|---|---|---|---|---|---|"]
    for name in ("real", "permuted"):
        for kind, x in (("raw", s[name]), ("Adam-scaled", s[name]["adam"])):
            b = "—" if x["b_noise"] is None else f"{x['b_noise']:.0f}"
            rows.append(f"| {name} | {kind} | {x['signal_sq']:.3g} [{x['signal_sq_ci'][0]:.3g}, {x['signal_sq_ci'][1]:.3g}] | "
                        f"{x['trace_cov']:.3g} | {b} | {x['split_half_cosine']:.3f} |")
    return (f"{s['real']['n']} draws at B={s['budget']}, L={s['interval']}, group {s['group']}; flat groups "
            f"{s['flat_groups']:.2f}, mean reward std {s['reward_std_mean']:.4f}\n" + "\n".join(rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--init", type=Path, required=True, help="the scorer GRPO would start from (its SFT checkpoint)")
    ap.add_argument("--traces-n", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    s = run(load_recipe(a.recipe, a.overrides), a.traces, a.init, a.out, a.traces_n, a.seed)
    print(noise_table(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
