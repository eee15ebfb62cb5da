"""``foresight sft --set sft.objective=kvpop``: KVpop scorers trained with the boundary loss (paper Eq. 7).

Per training trace, once: one dense pass gives the future-attention target and the scorer inputs
(:func:`foresight.targets.kvpop.kvpop_targets`); the teacher's static priorities (with decay) and its boundary
decisions at every query (:func:`foresight.scorers.kvpop_topk.boundary_pairs`, Fenwick) follow. Per step, for
``kvpop.queries_per_trace`` sampled boundary queries ``q ≥ s + w + k`` of each trace and every (layer, KV head)::

    loss = mean ω · softplus(−y · (p̂(t_new) − p̂(t_bnd)) / τ)

``p̂`` the student's static priority, ``y = ±1`` the teacher's keep/drop of ``t_new = q − w``, ``t_bnd`` the
teacher's cut-off token (k-th best of the eligible set before ``t_new`` arrives). Weights (App. B.4–B.5, whose
exact formulas the paper's text leaves out; these are ours): margin ``ω_m = min(1, Δ/margin)`` with ``Δ`` the
teacher's priority gap (near-ties, where the teacher is indifferent, count less); balance
``ω_b = clip(1/(2ρ_h))`` for keeps and ``clip(1/(2(1 − ρ_h)))`` for drops, ``ρ_h`` the head's keep share in the
batch. The scorer inputs come from the full-cache pass (the LLM is frozen; at inference layer ≥ 1 keys are
computed under eviction — the same train/inference gap as any scorer trained on dense activations).

Metrics: loss, boundary accuracy (sign agreement), and on the validation traces the top-k retention recall
against the teacher's top-k (paper Fig. 7) at every 16th query. Checkpointing, resume, DeepSpeed and the
standalone checkpoint are the plumbing shared with ForesightKV's stages (:mod:`foresight.training.runs`).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from foresight.runtime import distributed
from foresight.engine.models import portable_path
from foresight.scorers.kvpop import scorer_for_model
from foresight.targets.kvpop import kvpop_targets
from foresight.runtime.locks import locks_output
from foresight.scorers.kvpop_topk import boundary_pairs, topk_recall, trace_priority
from foresight.data.trace_data import training_fingerprints
from foresight.data.stage_inputs import load_stage_inputs
from foresight.training.outputs import RunOutput, finish_run, progress_bar, save_snapshot, summary_writer
from foresight.training.runs import TrainState, resumed_extra, run_identity, setup_training, train_plan
from foresight.training.steps import full_state_dict, mean_step, save_progress


@torch.no_grad()
def trace_example(model, ids: torch.Tensor, kvpop_cfg, k: int, log_gamma: torch.Tensor) -> dict:
    """Targets, inputs and teacher decisions of one trace [1, S] (kept on the CPU)."""
    data = kvpop_targets(model, ids, kvpop_cfg.window, kvpop_cfg.eps, kvpop_cfg.agg, kvpop_cfg.block)
    tgt = data["target"].cpu()  # [nl, h, S]
    nl, h, S = tgt.shape
    p = trace_priority(tgt, log_gamma.cpu()[:, :, None], kvpop_cfg.decay_step)
    pairs = boundary_pairs(p.reshape(nl * h, S), kvpop_cfg.sinks, kvpop_cfg.window, k)
    gap = (p.reshape(nl * h, S).gather(1, pairs["t_new"].expand(nl * h, -1)) -
           p.reshape(nl * h, S).gather(1, pairs["t_bnd"])).abs()
    return {"keys": data["keys"].cpu(), "values": data["values"].cpu(), "p": p, "q": pairs["q"],
            "t_new": pairs["t_new"], "t_bnd": pairs["t_bnd"].view(nl, h, -1), "keep": pairs["keep"].view(nl, h, -1),
            "gap": gap.view(nl, h, -1)}


def boundary_loss(p_hat: torch.Tensor, ex: dict, kvpop_cfg, idx: torch.Tensor | None = None):
    """Weighted boundary loss of a trace's student priorities p_hat [nl, h, S] at the queries ``idx`` (indices
    into ``ex['q']``; None = all). Returns (loss, accuracy of the keep/drop sign)."""
    t_new, t_bnd, keep, gap = ex["t_new"], ex["t_bnd"], ex["keep"], ex["gap"]
    if idx is not None:
        t_new, t_bnd, keep, gap = t_new[idx], t_bnd[..., idx], keep[..., idx], gap[..., idx]
    nl, h, _ = p_hat.shape
    dev = p_hat.device
    t_new, t_bnd, keep, gap = t_new.to(dev), t_bnd.to(dev), keep.to(dev), gap.to(dev)
    d = p_hat.gather(-1, t_new.expand(nl, h, -1)) - p_hat.gather(-1, t_bnd)
    y = keep.float() * 2 - 1
    w = torch.ones_like(d)
    if kvpop_cfg.margin > 0:
        w = w * (gap / kvpop_cfg.margin).clamp(max=1.0)
    rho = keep.float().mean(-1, keepdim=True).clamp(1e-6, 1 - 1e-6)
    w_keep = (1 / (2 * rho)).clamp(kvpop_cfg.balance_min, kvpop_cfg.balance_max)
    w_drop = (1 / (2 * (1 - rho))).clamp(kvpop_cfg.balance_min, kvpop_cfg.balance_max)
    w = w * torch.where(keep, w_keep, w_drop)
    loss = (w * torch.nn.functional.softplus(-y * d / kvpop_cfg.tau)).sum() / w.sum().clamp(min=1e-9)
    acc = ((d > 0) == keep).float().mean()
    return loss, acc


@locks_output("sft (kvpop)")
def train_kvpop(recipe, traces_dir, out, resume: bool = False, deepspeed_config=None, progress: bool = True,
                log=print):
    out = Path(out)
    cfg, kvpop_cfg, cache_cfg = recipe.sft, recipe.kvpop, recipe.cache
    rank, world = distributed.rank_world()
    device, model, ds, train_idx, val_idx = load_stage_inputs(recipe.sft, recipe.model, traces_dir, world)
    scorer = scorer_for_model(model, kvpop_cfg, cache_cfg.budget, cfg.seed).to(device)
    k = cache_cfg.budget - kvpop_cfg.sinks - kvpop_cfg.window
    plan = train_plan(cfg, identity=run_identity(recipe, ("model", "cache", "sft", "kvpop"), ds))
    opt, sched, ckpt, start, engine = setup_training(scorer, plan, out, resume, rank, deepspeed_config, "KVpop", log)

    examples: dict[int, dict] = {}

    def example(i):
        if i not in examples:
            ids = torch.tensor([ds[i]["input_ids"]], device=device)
            if ids.shape[1] <= kvpop_cfg.sinks + kvpop_cfg.window + k:
                raise ValueError(f"trace {i} has {ids.shape[1]} tokens: nothing is ever evicted at budget "
                                 f"{cache_cfg.budget}; lower cache.budget or use longer traces")
            examples[i] = trace_example(model, ids, kvpop_cfg, k, scorer.log_gamma)
        return examples[i]

    writer = summary_writer(out, rank)
    readout = "" if kvpop_cfg.scorer == "mlp" else ("-delayed" if kvpop_cfg.delayed else "-immediate")
    stage = f"kvpop-{kvpop_cfg.scorer}{readout}"
    provenance = {"training_data": portable_path(traces_dir), "training_traces": training_fingerprints(ds, train_idx),
                  "recipe": recipe.to_dict(), "objective": "kvpop"}
    run = RunOutput(out, model, recipe, stage, provenance)
    bar = progress_bar(start, cfg.steps, f"kvpop-{kvpop_cfg.scorer}", progress, rank)
    t0 = time.time()
    last = resumed_extra(ckpt).get("last", {}) if start else {}  # a resumed run reports its latest metrics
    for step in bar:
        rng = random.Random(cfg.seed * 1_000_003 + step)
        batch = [rng.choice(train_idx) for _ in range(cfg.batch_traces)]

        def trace_loss(j, step=step, batch=batch):  # each trace's query sample depends on (step, slot), not the rank
            ex = example(batch[j])
            nq = len(ex["q"])
            idx = None
            if kvpop_cfg.queries_per_trace and kvpop_cfg.queries_per_trace < nq:
                gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 64 + j)
                idx = torch.randperm(nq, generator=gen)[: kvpop_cfg.queries_per_trace]
            p_hat = scorer.sequence_priorities(ex["keys"].to(device), ex["values"].to(device))
            return boundary_loss(p_hat, ex, kvpop_cfg, idx)

        per_trace = mean_step(range(rank, len(batch), world), trace_loss, scorer, opt, engine, cfg.grad_clip)
        loss = torch.stack([x for x, _ in per_trace]).mean()
        accs = [a for _, a in per_trace]
        if engine is None:
            sched.step()
        last = {"loss": loss.item(), "boundary_acc": torch.stack(accs).mean().item(), "lr": opt.param_groups[0]["lr"]}
        if writer is not None:
            for name, v in last.items():
                writer.add_scalar(f"kvpop/{name}", v, step)
        bar.set_postfix(loss=f"{last['loss']:.4f}", acc=f"{last['boundary_acc']:.3f}")
        save_progress(step, plan, TrainState(scorer, opt, sched, ckpt, engine), rank, extra={"last": last},
                      snapshot=lambda w: save_snapshot(run, step + 1, w, scorer, last))
    metrics = {"train_loss": round(last.get("loss", float("nan")), 5),
               "train_boundary_acc": round(last.get("boundary_acc", float("nan")), 4), "steps": cfg.steps,
               "train_seconds_this_run": round(time.time() - t0, 1)}
    if val_idx:
        with torch.no_grad():
            accs, recalls = [], []
            for i in val_idx:
                ex = example(i)
                p_hat = scorer.sequence_priorities(ex["keys"].to(device), ex["values"].to(device)).cpu()
                accs.append(boundary_loss(p_hat, ex, kvpop_cfg)[1].item())
                nl, h, S = p_hat.shape
                qs = ex["q"][::16].tolist()
                recalls.append(topk_recall(ex["p"].reshape(nl * h, S), p_hat.reshape(nl * h, S), kvpop_cfg.sinks,
                                           kvpop_cfg.window, k, qs))
        metrics["val_boundary_acc"] = round(sum(accs) / len(accs), 4)
        metrics["val_topk_recall"] = round(sum(recalls) / len(recalls), 4)
    weights = full_state_dict(scorer, engine)
    if engine is not None and engine.zero_optimization_stage() == 3:
        scorer = scorer_for_model(model, kvpop_cfg, cache_cfg.budget, cfg.seed)
        scorer.load_state_dict(weights)
    finish_run(run, rank, world, weights, scorer, metrics, writer, log)
    return scorer, metrics
