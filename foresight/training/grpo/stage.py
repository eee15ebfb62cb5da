"""Stage two (``foresight grpo``): eviction as an MDP, refined with clipped GRPO and a KL to the SFT scorers.

* **Rollouts.** For each trace, ``G`` trajectories (``grpo.group``; 8 in the GPU recipes, independent of the
  number of processes) of eviction decisions drawn by the current scorers with the Top-2L sampler, during
  *one* teacher-forced pass of the frozen LLM in which the G copies of the trace are one batch.
  No gradient flows through the LLM (``torch.no_grad``; only the scorers have ``requires_grad``).
* **Budgets.** At the cache's B and L, or with ``grpo.budgets`` ("B:L,B:L") at each of several in turn over a step's
  traces (its k-th trace at the (k mod n)-th budget), so that a scorer refined at one budget is not left worse at
  the others (SFT's ``sft.budgets`` does the same for the golden ranking).
* **Reward.** :mod:`foresight.targets.reward` (the exact formula is in its docstring), from the full-cache loss and
  entropy stored by the data stage.
* **Advantage.** ``A_g = (r_g − mean(r)) / (std(r) + 1e-6)`` within the trace's group, ``std`` Bessel-corrected
  (TRL's ``nanstd``; the released code divides by the population std, a constant factor √(G/(G−1)) apart).
* **Log-probabilities.** Each (step, layer, KV head) row's action is the drawn *set* of L evictions, with the
  exact Plackett–Luce set probability under the Top-2L sampler (:func:`foresight.engine.selection.set_logprob`), or
  its ordered draws (``grpo.ratio``, below); the released code uses an independent softmax over all
  candidates, which is not the law it samples from. It is recomputed for the updated scorers from the stored
  per-step scorer inputs, without re-running the LLM, over the behaviour policy's Top-2L window (the window
  is a deterministic truncation, held fixed like top-k truncation in language-model RL, so an updated policy
  never assigns a drawn action probability 0).
* **Objective** (minimised), per row with ratio ``ρ = exp(log π_θ − log π_old)``::

      −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) + β·k3,    k3 = exp(δ) − δ − 1,   δ = log π_ref − log π_θ

  averaged over rows, steps and traces, optimised for ``grpo.epochs`` (μ ≥ 1) passes over each batch so the
  clip can act. ``π_ref`` is the frozen SFT scorer bank. What ``π`` is, ``grpo.ratio``:

  - ``set`` — the drawn set's probability, its log-ratio shared out over its L draws (``ρ = exp(Δ/L)``, the same
    for δ). A set whose probability changed e^3-fold has ρ = e^(3/32) = 1.10 at L = 32: measured on SmolLM2, the
    clip fraction stayed 0.00 while half of the top-L decisions changed (docs/results/smollm2-135m/
    probe-sft-variants/grpo), so the clip never bounds an epoch's step. On the tiny teacher at 32 traces per step
    and lr 3e-4 this let the scorer overshoot and then lose its own reward (−0.42 → −0.79 in 10 steps) where
    ``draw`` improved for 30 steps (docs/results/tiny-qwen3/grpo-32traces). Kept for comparison.
  - ``draw`` (the default) — each draw of the ordered Plackett–Luce sequence is an action of its own
    (:func:`foresight.engine.selection.window_draw_logprobs`: P(draw i | the earlier draws) over the fixed window), with
    its own ratio, clip and k3 term, averaged over the L draws like language-model GRPO's per-token terms. The
    ordered sequence is the sampler's actual outcome, so its log-probability is a valid policy-gradient action
    (the reward depends on the set only); the clip now acts on every draw whose probability moved by more
    than ε. Cheaper than ``set`` (no integral).
"""

from __future__ import annotations

import copy
import random
import time
import warnings
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from foresight.runtime import distributed
from foresight.engine.models import portable_path
from foresight.scorers.checkpoint import load_scorer
from foresight.runtime.locks import locks_output
from foresight.engine.models import load_model
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import parse_budgets
from foresight.training.grpo.objective import group_advantage, step_objective, trajectory_reward
from foresight.training.grpo.rollout import GroupSampling, group_rollout
from foresight.training.grpo.heldout import change_since_start, first_scored_token, scalars, validate
from foresight.data.trace_data import load_traces, training_fingerprints
from foresight.data.stage_inputs import check_traces_model, split_traces
from foresight.training.outputs import RunOutput, finish_run, progress_bar, save_snapshot, summary_writer
from foresight.training.runs import TrainState, resumed_extra, run_identity, setup_training, train_plan
from foresight.training.steps import full_state_dict, optimizer_step, save_progress


def training_settings(recipe) -> list[EvictionSettings]:
    """The eviction settings GRPO rolls out at: one per ``grpo.budgets`` entry, or the cache's own. Validation runs at
    the cache's."""
    if not recipe.grpo.budgets:
        return [recipe.cache]
    return [recipe.cache.replace(budget=B, interval=L) for B, L in parse_budgets(recipe.grpo.budgets)]


@locks_output("grpo")
def train_grpo(recipe, traces_dir, init, out, resume: bool = False, deepspeed_config=None, progress: bool = True,
               log=print):
    out = Path(out)
    grpo_cfg, settings = recipe.grpo, recipe.cache
    rank, world = distributed.rank_world()
    if grpo_cfg.traces_per_step % world:
        raise ValueError(f"grpo.traces_per_step={grpo_cfg.traces_per_step} must be divisible by the number of "
                         f"processes ({world})")
    if grpo_cfg.group < 2:
        raise ValueError(f"grpo.group must be >= 2 (advantages are relative to the group), got {grpo_cfg.group}")
    if grpo_cfg.low_entropy_below is not None and not grpo_cfg.low_entropy_below > 0:
        raise ValueError(f"grpo.low_entropy_below must be a positive entropy in nats (or null), got {grpo_cfg.low_entropy_below}")
    if grpo_cfg.control not in ("none", "permuted"):
        raise ValueError(f"grpo.control must be 'none' or 'permuted', got {grpo_cfg.control!r}")
    if grpo_cfg.epochs < 1:
        raise ValueError(f"grpo.epochs must be >= 1, got {grpo_cfg.epochs}")
    rollout_settings = training_settings(recipe)
    if grpo_cfg.traces_per_step % len(rollout_settings):
        raise ValueError(f"grpo.traces_per_step={grpo_cfg.traces_per_step} must be a multiple of the number of "
                         f"grpo.budgets ({grpo_cfg.budgets!r}: {len(rollout_settings)}), so each budget gets as many traces")
    device = distributed.local_device(recipe.model.device)
    torch.manual_seed(grpo_cfg.seed)
    model, _ = load_model(recipe.model, device=str(device))
    bank, init_cfg = load_scorer(init, model)
    if (init_cfg["budget"], init_cfg["interval"]) != (settings.budget, settings.interval):
        log(f"[grpo] note: SFT scorers were trained at B={init_cfg['budget']}, L={init_cfg['interval']}; "
            f"GRPO runs at B={settings.budget}, L={settings.interval}")
    bank.train().requires_grad_(True)
    ref = copy.deepcopy(bank).eval().requires_grad_(False)
    ds = load_traces(traces_dir)
    check_traces_model(ds, traces_dir, recipe.model, model)
    train_idx, val_idx = split_traces(len(ds), grpo_cfg.val_traces)
    # a constant rate after warm-up; the schedule stays ours under DeepSpeed: GRPO takes `epochs` optimiser steps
    # per training step and steps the schedule once
    plan = train_plan(grpo_cfg, schedule="constant", batch_traces=grpo_cfg.traces_per_step, grad_clip=1.0, engine_schedules=False,
                      identity=run_identity(recipe, ("model", "cache", "grpo"), ds, init=init_cfg.get("created")))
    opt, sched, ckpt, start, engine = setup_training(bank, plan, out, resume, rank, deepspeed_config, "GRPO", log)
    writer = summary_writer(out, rank)
    provenance = {"training_data": portable_path(traces_dir), "init": portable_path(init),
                  "training_traces": training_fingerprints(ds, train_idx, init_cfg), "recipe": recipe.to_dict()}
    run = RunOutput(out, model, recipe, "grpo", provenance)
    resumed = resumed_extra(ckpt) if start else {}  # a resumed run keeps what it measured before
    first_val = validate(model, bank, ds, val_idx, settings, grpo_cfg) if (val_idx and start == 0) else \
        resumed.get("first_val")

    def validation_point() -> dict:  # the held-out figures now, and their change since the SFT start (paired)
        val = validate(model, bank, ds, val_idx, settings, grpo_cfg)
        return {**scalars(val), **change_since_start(val, first_val)}

    bar = progress_bar(start, grpo_cfg.steps, "grpo", progress, rank)
    t0 = time.time()
    hist = list(resumed.get("history", [])) or ([resumed["last"]] if resumed.get("last") else [])
    for step in bar:
        rng = random.Random(grpo_cfg.seed * 1_000_003 + step)
        batch = [rng.choice(train_idx) for _ in range(grpo_cfg.traces_per_step)][rank::world]
        groups = []
        for j, i in enumerate(batch):
            row = ds[i]
            ids = torch.tensor([row["input_ids"]], device=device)
            slot = rank + j * world  # the trace's place in the global batch: sampling does not depend on world size
            draw_seed = grpo_cfg.seed * 7919 + step * 131 + slot
            gen = torch.Generator(device=device).manual_seed(draw_seed)
            at = rollout_settings[slot % len(rollout_settings)]  # grpo.budgets in turn over the batch's traces
            bank.eval()
            res, steps, overlap = group_rollout(model, bank, ids, GroupSampling.from_grpo(grpo_cfg), at, gen,
                                                row["prompt_len"])
            r = trajectory_reward(res.token_loss, torch.tensor(row["token_loss"], device=device),
                                  torch.tensor(row["token_entropy"], device=device),
                                  first_scored_token(at, row["prompt_len"]), grpo_cfg)
            if grpo_cfg.control == "permuted":  # the null control: rewards no longer belong to their trajectories
                perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(draw_seed))
                r = r[perm.to(r.device)]
            groups.append((steps, r, group_advantage(r), overlap))
        bank.train()
        flat = sum(float(x[1].std() < 1e-8) for x in groups)
        skip = grpo_cfg.skip_flat and distributed.sum_across(len(groups) - flat, device) == 0
        stats = {"loss": 0.0, "kl": hist[-1]["kl"] if hist else 0.0, "clip_frac": 0.0}  # a skipped step: unchanged
        for _ in range(0 if skip else grpo_cfg.epochs):
            losses, kls, clips = [], [], []
            for steps, r, adv, _ in groups:
                if not steps:
                    continue
                trace_losses = []
                for s in steps:
                    # recomputed in the backward pass (the Plackett-Luce integral's grid is large): the graph of a
                    # whole batch of steps would otherwise be held at once
                    loss, kl, clip = checkpoint(step_objective, bank, ref, s, adv, grpo_cfg, use_reentrant=False)
                    trace_losses.append(loss)
                    kls.append(kl.item())
                    clips.append(clip.item())
                losses.append(torch.stack(trace_losses).mean())  # mean over a trace's steps, then over traces
            if not losses:
                raise ValueError("no eviction happened in this batch: traces are shorter than B + L")
            loss = torch.stack(losses).mean()
            optimizer_step(loss, bank, opt, engine, plan.grad_clip)
            stats = {"loss": loss.item(), "kl": sum(kls) / len(kls), "clip_frac": sum(clips) / len(clips)}
        with warnings.catch_warnings():  # a skipped step still advances the schedule (it counts as a step), and torch
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")  # warns at step 0
            sched.step()
        rewards = torch.cat([x[1] for x in groups])
        stats.update({"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
                      "adv_abs": torch.cat([x[2] for x in groups]).abs().mean().item(), "lr": opt.param_groups[0]["lr"],
                      # exploration: how alike the group's eviction sets are, and groups whose rewards are all equal
                      # (zero advantage: only the KL term moves the scorers on them)
                      "group_overlap": sum(x[3] for x in groups) / len(groups),
                      "flat_groups": flat / len(groups), "skipped": float(skip)})
        hist.append(stats)
        if writer is not None:
            for k, v in stats.items():
                writer.add_scalar(f"grpo/{k}", v, step)
        bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", kl=f"{stats['kl']:.4f}", clip=f"{stats['clip_frac']:.2f}")
        if val_idx and ((step + 1) % plan.ckpt_every == 0 or step + 1 == plan.steps):
            # on every rank (ZeRO-3's partitioned scorers gather in each forward), before the checkpoint: a resumed
            # run's curve keeps this point
            stats.update(validation_point())
            if writer is not None:
                for k in ("val_loss_ratio", "val_reward", "val_loss_ratio_change"):
                    if k in stats:
                        writer.add_scalar(f"grpo/{k}", stats[k], step)
        save_progress(step, plan, TrainState(bank, opt, sched, ckpt, engine), rank,  # every rank (ZeRO-3 gathers)
                      extra={"first_val": first_val, "last": stats, "history": hist},
                      snapshot=lambda w: save_snapshot(run, step + 1, w, bank, stats))
    metrics = {"steps": grpo_cfg.steps, "group": grpo_cfg.group, "val_traces": len(val_idx),
               "train_seconds_this_run": round(time.time() - t0, 1)}
    if hist:
        metrics["last_reward_mean"] = round(hist[-1]["reward_mean"], 5)
        metrics["history"] = [{k: round(v, 6) for k, v in h.items()} for h in hist]  # per step: reward, KL, clipping
    if val_idx:
        final = hist[-1] if hist and "val_reward" in hist[-1] else validation_point()
        metrics.update({k: round(v, 5) for k, v in final.items() if k.startswith("val_")})
        if first_val:
            metrics.update({f"sft_{k}": round(v, 5) for k, v in scalars(first_val).items()})
    finish_run(run, rank, world, full_state_dict(bank, engine), bank, metrics, writer, log)
    return bank, metrics
