"""Stage one (``foresight sft``): scorers learn the Golden Eviction ranking with a pairwise hinge loss.

For every training trace: golden future scores (:mod:`foresight.golden`), then one teacher-forced pass that
*follows the golden decisions* (so the features are exactly what the engine produces along that trajectory)
yields, per eviction step, the scorer inputs of all candidates. Loss (paper §3.2)::

    L = mean_{layers, rows} mean_{(i, j) in row : F_i < F_j} max(0, m − (φ_i − φ_j))

a row being one (layer, step, KV head); ``F`` the golden future score, ``φ`` the scorer's eviction score (i
should go before j). ``sft.pairs = all`` uses every pair (chunked), ``sampled`` a random subset of
``sft.sampled_pairs`` pairs per row. Metrics: loss, recall@L of the scorer's eviction set against the golden
set (per layer), learning rate — to TensorBoard (``OUT/tb``).

Checkpoints: ``OUT/ckpt/state.pt`` every ``sft.ckpt_every`` steps (atomic); ``--resume`` continues exactly
(batches depend only on the step number and the seed). The final scorers are a standalone checkpoint in OUT.
Multi-process: ``deepspeed --num_gpus N -m foresight sft ... --deepspeed recipes/ds/zero2.json``; each rank
takes a disjoint share of every batch and DeepSpeed averages the gradients.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path

import torch

from foresight import distributed
from foresight.golden import GoldenPolicy, block_pooled_attention
from foresight.models import describe, load_model
from foresight.rollout import rollout
from foresight.scorer import ScorerBank, bank_for_model, save_scorer
from foresight.traces import load_traces


# ------------------------------------------------------------------------------------------------ examples
@torch.no_grad()
def golden_examples(model, input_ids: torch.Tensor, bank: ScorerBank, budget: int, interval: int, sinks: int = 0,
                    pool: str = "mean", device="cpu", protect_prompt: bool = False, prompt_len: int | None = None):
    """Per eviction step along the golden trajectory: (inputs [nl,1,h,n,D], future [nl,1,h,n], candidates)."""
    F = block_pooled_attention(model, input_ids, budget, interval, pool).future()
    policy = GoldenPolicy(F)
    out = []

    def rec(st):
        v = st["view"]
        out.append((bank.inputs(v).to(device), policy.future_scores(v).to(device), st["evictable"].to(device)))

    rollout(model, input_ids, policy, budget, interval, sinks=sinks, recorder=rec, protect_prompt=protect_prompt,
            prompt_len=prompt_len)
    return out


def pairwise_hinge(phi, fut, cand, margin: float = 0.01, mode: str = "all", sampled: int = 4096,
                   chunk: int = 1 << 24, generator=None):
    """Per-row mean hinge over ordered pairs; phi, fut, cand: [R, n]. Returns (mean over rows with pairs, rows)."""
    R, n = phi.shape
    if mode == "all":
        per_row = []
        rows_per_chunk = max(1, chunk // max(1, n * n))
        for r0 in range(0, R, rows_per_chunk):
            p, f, c = phi[r0:r0 + rows_per_chunk], fut[r0:r0 + rows_per_chunk], cand[r0:r0 + rows_per_chunk]
            pair = (f.unsqueeze(2) < f.unsqueeze(1)) & c.unsqueeze(2) & c.unsqueeze(1)
            h = torch.relu(margin - (p.unsqueeze(2) - p.unsqueeze(1))) * pair
            per_row.append(torch.stack([h.sum((1, 2)), pair.sum((1, 2)).float()], -1))
        sums = torch.cat(per_row)
    elif mode == "sampled":
        i = torch.randint(0, n, (R, sampled), generator=generator).to(phi.device)
        j = torch.randint(0, n, (R, sampled), generator=generator).to(phi.device)
        fi, fj = fut.gather(1, i), fut.gather(1, j)
        ok = cand.gather(1, i) & cand.gather(1, j) & (fi != fj)
        lo_i = fi < fj  # orient each pair so that the first element should be evicted first
        pi, pj = phi.gather(1, i), phi.gather(1, j)
        d = torch.where(lo_i, pi - pj, pj - pi)
        h = torch.relu(margin - d) * ok
        sums = torch.stack([h.sum(1), ok.sum(1).float()], -1)
    else:
        raise ValueError(f"sft.pairs must be 'all' or 'sampled', got {mode!r}")
    has = sums[:, 1] > 0
    if not has.any():
        return phi.sum() * 0.0, 0
    return (sums[has, 0] / sums[has, 1]).mean(), int(has.sum())


def recall_at_l(phi, fut, cand, k: int) -> torch.Tensor:
    """[R] |scorer's top-k eviction set ∩ golden set| / k within each row's candidates."""
    neg = torch.finfo(phi.dtype).min
    mine = phi.masked_fill(~cand, neg).topk(k, -1).indices
    gold = (-fut).masked_fill(~cand, neg).topk(k, -1).indices
    hit = (mine.unsqueeze(-1) == gold.unsqueeze(-2)).any(-1).float().sum(-1)
    return hit / k


def example_loss(bank, examples, cfg, interval, generator=None):
    """Loss and per-layer recall over a trace's golden steps (rows = layer × step × head)."""
    nl = bank.num_layers
    phis, futs, cands = [], [], []
    for x, f, c in examples:
        phis.append(bank(x).reshape(nl, -1, x.shape[3]))
        futs.append(f.reshape(nl, -1, x.shape[3]))
        cands.append(c.reshape(nl, -1, x.shape[3]))
    phi, fut, cand = torch.cat(phis, 1), torch.cat(futs, 1), torch.cat(cands, 1)  # [nl, rows, n]
    loss, _ = pairwise_hinge(phi.flatten(0, 1), fut.flatten(0, 1), cand.flatten(0, 1), cfg.margin, cfg.pairs,
                             cfg.sampled_pairs, cfg.pair_chunk, generator)
    with torch.no_grad():
        rec = recall_at_l(phi.flatten(0, 1), fut.flatten(0, 1), cand.flatten(0, 1), interval).view(nl, -1).mean(1)
    return loss, rec


def lr_lambda(step: int, warmup: int, total: int, schedule: str):
    if step < warmup:
        return (step + 1) / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def atomic_save(obj, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(ckpt: Path, resume: bool, rank: int, bank, opt, sched, stage: str, log=print) -> int:
    """``--resume``: restore bank, optimizer (when saved) and schedule from ``ckpt``; returns the step to start
    at. Without ``--resume`` a folder that already holds a run of this stage is refused (nothing is lost)."""
    if not resume:
        if rank == 0 and ckpt.exists():
            raise ValueError(f"{ckpt.parent.parent} already holds a {stage} run; pass --resume to continue it "
                             "or choose a new --out")
        return 0
    if not ckpt.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt}")
    st = torch.load(ckpt, weights_only=False, map_location="cpu")
    bank.load_state_dict(st["bank"])
    if st.get("opt") is not None:
        opt.load_state_dict(st["opt"])
    sched.load_state_dict(st["sched"])
    log(f"[{stage.lower()}] resumed at step {st['step']}")
    return st["step"]


def split_traces(n: int, val: int) -> tuple[list[int], list[int]]:
    val = min(val, n // 4)
    return list(range(n - val)), list(range(n - val, n))


# ------------------------------------------------------------------------------------------------ training
def train_sft(recipe, traces_dir, out, resume: bool = False, deepspeed_config=None, progress: bool = True, log=print):
    out = Path(out)
    cfg, cc = recipe.sft, recipe.cache
    rank, world = distributed.rank_world()
    if cfg.objective == "kvpop":
        from foresight.kvpop.train import train_kvpop

        return train_kvpop(recipe, traces_dir, out, resume, deepspeed_config, progress, log)
    if cfg.objective != "foresight":
        raise ValueError(f"sft.objective={cfg.objective!r} is not available (foresight | kvpop)")
    device, model, ds, train_idx, val_idx = load_stage_inputs(recipe, traces_dir, world)
    bank = bank_for_model(model, recipe.scorer.hidden, recipe.scorer.activation, recipe.scorer.features, cfg.seed)
    plan = train_plan(cfg)
    opt, sched, ckpt, start, engine = setup_training(bank, plan, out, resume, rank, deepspeed_config, "SFT", log)

    cache_examples: dict[int, list] = {}

    def examples_for(i):
        if i in cache_examples:
            return cache_examples[i]
        row = ds[i]
        ids = torch.tensor([row["input_ids"]], device=device)
        ex = golden_examples(model, ids, bank, cc.budget, cc.interval, cc.sinks, cfg.golden_pool,
                             protect_prompt=cc.protect_prompt, prompt_len=row["prompt_len"])
        if getattr(cfg, "cache_golden", True):
            cache_examples[i] = ex
        return ex

    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tb"))
    from tqdm import tqdm

    bar = tqdm(range(start, cfg.steps), desc="sft", disable=not progress or rank != 0, initial=start, total=cfg.steps)
    t0 = time.time()
    last = {}
    for step in bar:
        rng = random.Random(cfg.seed * 1_000_003 + step)
        batch = [rng.choice(train_idx) for _ in range(cfg.batch_traces)]
        mine = batch[rank::world]
        gen = torch.Generator().manual_seed(cfg.seed * 7 + step)
        losses, recalls = [], []
        for i in mine:
            loss, rec = example_loss(bank, examples_for(i), cfg, cc.interval, gen)
            losses.append(loss)
            recalls.append(rec)
        loss = torch.stack(losses).mean()
        optimizer_step(loss, bank, opt, engine, cfg.grad_clip)
        if engine is None:
            sched.step()  # under DeepSpeed the engine steps the schedule it was given
        rec = torch.stack(recalls).mean(0)
        last = {"loss": loss.item(), "recall": rec.mean().item(), "lr": opt.param_groups[0]["lr"]}
        if writer is not None:
            writer.add_scalar("sft/loss", last["loss"], step)
            writer.add_scalar("sft/lr", last["lr"], step)
            for layer, r in enumerate(rec.tolist()):
                writer.add_scalar(f"sft/recall@L/layer{layer}", r, step)
        bar.set_postfix(loss=f"{last['loss']:.4f}", recall=f"{last['recall']:.3f}")
        save_progress(step, plan, bank, opt, sched, engine, ckpt, rank)
    train_seconds = time.time() - t0
    metrics = {"train_loss": round(last.get("loss", float("nan")), 5),
               "train_recall_at_L": round(last.get("recall", float("nan")), 4), "steps": cfg.steps,
               "train_seconds_this_run": round(train_seconds, 1)}
    if val_idx:
        with torch.no_grad():
            vals = [example_loss(bank, examples_for(i), cfg, cc.interval, torch.Generator().manual_seed(0)) for i in val_idx]
        metrics["val_loss"] = round(torch.stack([v[0] for v in vals]).mean().item(), 5)
        metrics["val_recall_at_L"] = round(torch.stack([v[1] for v in vals]).mean().item(), 4)
        metrics["val_recall_at_L_per_layer"] = [round(x, 4) for x in torch.stack([v[1] for v in vals]).mean(0).tolist()]
    weights = full_state_dict(bank, engine)
    if engine is not None and engine.zero_optimization_stage() == 3:
        bank = bank_for_model(model, recipe.scorer.hidden, recipe.scorer.activation, recipe.scorer.features)
        bank.load_state_dict(weights)  # a plain, unpartitioned copy for saving and for the caller
    finish_run(out, rank, world, weights, bank, model, recipe, "sft", metrics,
               {"training_data": str(traces_dir), "recipe": recipe.to_dict()}, writer, log)
    return bank, metrics


def load_stage_inputs(recipe, traces_dir, world: int):
    """What a scorer-training stage starts from: the device, the frozen LLM, the traces and their train/validation
    split (the last 2 traces validate); clear errors for an indivisible batch or an empty dataset."""
    cfg = recipe.sft
    if cfg.batch_traces % world:
        raise ValueError(f"sft.batch_traces={cfg.batch_traces} must be divisible by the number of processes ({world})")
    device = distributed.local_device(recipe.model.device)
    torch.manual_seed(cfg.seed)
    model, _ = load_model(recipe.model, device=str(device))
    ds = load_traces(traces_dir)
    train_idx, val_idx = split_traces(len(ds), 2)
    if not train_idx:
        raise ValueError(f"no training traces in {traces_dir}")
    return device, model, ds, train_idx, val_idx


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What the plumbing shared by the training stages reads: optimiser, schedule, checkpoints, DeepSpeed. SFT and
    KVpop take it from the ``sft`` section as is; GRPO from ``grpo`` (see :func:`train_plan`)."""

    lr: float
    warmup: int
    steps: int
    schedule: str
    batch_traces: int  # traces per optimiser step over all processes
    grad_clip: float
    ckpt_every: int
    deepspeed: str | None = None
    engine_schedules: bool = True  # under DeepSpeed, the engine steps the schedule at each optimiser step


def train_plan(section, **overrides) -> TrainPlan:
    """A :class:`TrainPlan` from a recipe section's fields of the same names, plus ``overrides``."""
    names = [f.name for f in dataclasses.fields(TrainPlan)]
    return TrainPlan(**{n: getattr(section, n) for n in names if hasattr(section, n)} | overrides)


def setup_training(module, plan: TrainPlan, out: Path, resume: bool, rank: int, deepspeed_config, stage: str, log):
    """Adam + the warm-up/cosine (or constant) schedule for ``module``, the run's checkpoint (restored with
    ``--resume``, before DeepSpeed wraps anything: ZeRO partitions what is loaded) and the DeepSpeed engine when
    configured. Returns (opt, sched, ckpt path, first step, engine or None)."""
    opt = torch.optim.Adam(module.parameters(), lr=plan.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, plan.warmup, plan.steps, plan.schedule))
    ckpt = out / "ckpt" / "state.pt"
    start = load_checkpoint(ckpt, resume, rank, module, opt, sched, stage, log)
    engine = None
    ds_cfg = deepspeed_config or plan.deepspeed
    if ds_cfg:
        engine = _deepspeed_engine(module, opt, sched if plan.engine_schedules else None, ds_cfg, plan)
    return opt, sched, ckpt, start, engine


def save_progress(step: int, plan: TrainPlan, module, opt, sched, engine, ckpt: Path, rank: int) -> dict | None:
    """Every ``ckpt_every`` steps and at the end: the resumable state, written atomically by rank 0. Call on every
    rank. Returns the full weights it saved (None when no checkpoint was due)."""
    if (step + 1) % plan.ckpt_every == 0 or step + 1 == plan.steps:
        weights = full_state_dict(module, engine)  # collective under ZeRO-3: every rank takes part
        if rank == 0:
            # under DeepSpeed the Adam moments live in its partitions: a resumed DeepSpeed run restarts them
            atomic_save({"bank": weights, "opt": opt.state_dict() if engine is None else None,
                         "sched": sched.state_dict(), "step": step + 1}, ckpt)
        return weights
    return None


def finish_run(out: Path, rank: int, world: int, weights: dict, bank, model, recipe, stage: str, metrics: dict,
               extra: dict, writer, log) -> None:
    """End of a training stage: every rank's final weights (multi-process runs, so agreement can be checked),
    then on rank 0 the standalone scorer checkpoint, ``metrics.json`` and the TensorBoard writer's close."""
    if world > 1:
        from safetensors.torch import save_file

        (out / "ckpt").mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous().cpu() for k, v in weights.items()},
                  str(out / "ckpt" / f"final-rank{rank}.safetensors"))
    if rank == 0:
        cc = recipe.cache
        save_scorer(bank, out, describe(model) | {"revision": recipe.model.revision, "path": recipe.model.path,
                                                  "gguf_file": recipe.model.gguf_file},
                    cc.budget, cc.interval, cc.sinks, stage, metrics, extra=extra)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        if writer is not None:
            writer.close()
        log(f"[{stage}] done: {json.dumps(metrics)}")
    distributed.barrier()


def optimizer_step(loss, bank, opt, engine, grad_clip: float) -> None:
    """Backward and one optimiser step, through DeepSpeed when it wraps the bank (it averages the gradients of
    the processes and clips by its config) or directly with gradient clipping."""
    if engine is not None:
        engine.backward(loss)
        engine.step()
        return
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(bank.parameters(), grad_clip)
    opt.step()


def full_state_dict(bank, engine) -> dict:
    """The bank's full weights; under ZeRO-3 the partitions are gathered (a collective: call on every rank)."""
    if engine is not None and engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(bank.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in bank.state_dict().items()}
    return {k: v.detach().clone() for k, v in bank.state_dict().items()}


def _deepspeed_engine(bank, opt, sched, ds_cfg, plan: TrainPlan):
    import deepspeed

    conf = json.loads(Path(ds_cfg).read_text()) if not isinstance(ds_cfg, dict) else dict(ds_cfg)
    _, world = distributed.rank_world()
    conf.setdefault("train_micro_batch_size_per_gpu", max(1, plan.batch_traces // world))
    conf.setdefault("gradient_accumulation_steps", 1)
    conf.setdefault("gradient_clipping", plan.grad_clip)
    zero = conf.get("zero_optimization") or {}
    if zero.get("stage") == 3:
        # ZeRO-3 gathers a partitioned parameter at every forward call, a collective; the scorers run once per
        # eviction step of each process's own traces, whose counts differ between processes (a hang). Scorer banks
        # are small (1.5 M values for Qwen3-4B), so they stay whole on every rank; ZeRO-3 still partitions the
        # gradients and the optimiser state.
        n = sum(p.numel() for p in bank.parameters())
        conf["zero_optimization"] = {**zero, "stage3_param_persistence_threshold": max(
            n + 1, zero.get("stage3_param_persistence_threshold", 0))}
    engine, _, _, _ = deepspeed.initialize(model=bank, optimizer=opt, lr_scheduler=sched,
                                           model_parameters=bank.parameters(), config=conf)
    return engine
