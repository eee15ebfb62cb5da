"""Plumbing shared by the scorer-training stages — ForesightKV's SFT (:mod:`foresight.training.sft`) and GRPO
(:mod:`foresight.training.grpo.stage`), and KVpop's boundary-loss training (:mod:`foresight.training.kvpop`).

* **Inputs** (:mod:`foresight.data.stage_inputs`): the device, the frozen LLM, the traces and their train/validation split.
* **Plan** (:class:`TrainPlan`, :func:`train_plan`): what the plumbing reads from a recipe section — optimiser,
  schedule (linear warm-up, then cosine or constant: :func:`lr_lambda`), checkpoint interval, DeepSpeed.
* **Setup** (:func:`setup_training`): Adam, the schedule, ``--resume`` from ``OUT/ckpt/state.pt``
  (:func:`load_checkpoint`; a folder that already holds a run is refused without it) and the DeepSpeed engine.
* **Steps** (:func:`optimizer_step`, :func:`mean_step`, :func:`save_progress`): backward and one optimiser step
  (through DeepSpeed when it wraps the scorers; :func:`mean_step` frees each item's graph before the next); the
  resumable state every ``ckpt_every`` steps and at the end, written atomically (:func:`foresight.runtime.atomic.torch_save`)
  by rank 0.
* **Snapshots** (:func:`save_snapshot`): with ``snapshots: true``, a standalone scorer checkpoint at every checkpoint
  step (``OUT/steps/step-NNNNNN``), for a held-out curve of the run.
* **End** (:func:`finish_run`): the standalone scorer checkpoint (:func:`foresight.scorers.checkpoint.save_scorer`),
  ``metrics.json``, and in multi-process runs every rank's final weights.
* **Logging** (:func:`summary_writer`, :func:`progress_bar`): TensorBoard (``OUT/tb``) and the tqdm bar, on rank 0.

Under ZeRO-3 the scorers stay whole on every rank (see :func:`_deepspeed_engine`); :func:`full_state_dict`
gathers them all the same, a collective that every rank must call.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from foresight.runtime import atomic, distributed
from foresight.scorers.checkpoint import save_scorer
from foresight.engine.models import describe


# ------------------------------------------------------------------------------------------------ plan, setup
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
    snapshots: bool = False  # the stage also keeps a standalone scorer checkpoint at every checkpoint (save_snapshot)
    engine_schedules: bool = True  # under DeepSpeed, the engine steps the schedule at each optimiser step
    identity: dict | None = None  # what a resumed run must match (see run_identity); None: not checked


def train_plan(section, **overrides) -> TrainPlan:
    """A :class:`TrainPlan` from a recipe section's fields of the same names, plus ``overrides``."""
    names = [f.name for f in dataclasses.fields(TrainPlan)]
    return TrainPlan(**{n: getattr(section, n) for n in names if hasattr(section, n)} | overrides)


def run_identity(recipe, sections: tuple[str, ...], ds, **extra) -> dict:
    """What a run's checkpoint must agree with on ``--resume``: the recipe ``sections`` it trains by and the traces
    (their dataset fingerprint), plus ``extra`` (e.g. GRPO's initial scorers)."""
    d = recipe.to_dict()
    d["model"].pop("device", None)  # where it runs is not what it trains
    return {"recipe": {s: d[s] for s in sections}, "traces": getattr(ds, "_fingerprint", None), **extra}


# what a resumed run may change in its stage's section: how long, how often it checkpoints, how it is distributed
RESUMABLE_CHANGES = ("steps", "ckpt_every", "deepspeed", "cache_golden", "snapshots")


def identity_changes(saved: dict, now: dict) -> list[str]:
    """The differences between a checkpoint's identity and this run's, except the fields a resume may change (a field
    the checkpoint does not know, added to the recipes later, counts as its default)."""
    from foresight.config.recipe import Recipe

    out, defaults = [], Recipe().to_dict()
    for sec, fields in now.get("recipe", {}).items():
        for k, v in fields.items():
            mine = saved.get("recipe", {}).get(sec, {})
            # a field added after the checkpoint was written ran with its default there
            old = mine[k] if k in mine else defaults.get(sec, {}).get(k)
            if old != v and not (sec in ("sft", "grpo") and k in RESUMABLE_CHANGES):
                out.append(f"{sec}.{k}: {old!r} -> {v!r}")
    out += [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in now.items() if k != "recipe" and saved.get(k) != v]
    return out


def lr_lambda(step: int, warmup: int, total: int, schedule: str):
    if step < warmup:
        return (step + 1) / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def setup_training(module, plan: TrainPlan, out: Path, resume: bool, rank: int, deepspeed_config, stage: str, log):
    """Adam + the warm-up/cosine (or constant) schedule for ``module``, the run's checkpoint (restored with
    ``--resume``, before DeepSpeed wraps anything: ZeRO partitions what is loaded) and the DeepSpeed engine when
    configured. Returns (opt, sched, ckpt path, first step, engine or None)."""
    opt = torch.optim.Adam(module.parameters(), lr=plan.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, plan.warmup, plan.steps, plan.schedule))
    ckpt = out / "ckpt" / "state.pt"
    start = load_checkpoint(ckpt, resume, rank, module, opt, sched, stage, log, plan)
    engine = None
    ds_cfg = deepspeed_config or plan.deepspeed
    if ds_cfg:
        engine = _deepspeed_engine(module, opt, sched if plan.engine_schedules else None, ds_cfg, plan)
    return opt, sched, ckpt, start, engine


def _deepspeed_engine(bank, opt, sched, ds_cfg, plan: TrainPlan):
    import deepspeed

    try:
        conf = json.loads(Path(ds_cfg).read_text()) if not isinstance(ds_cfg, dict) else dict(ds_cfg)
    except (OSError, ValueError) as e:
        raise ValueError(f"DeepSpeed config {ds_cfg}: {e}") from None
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


# ------------------------------------------------------------------------------------------------ checkpoints
def load_checkpoint(ckpt: Path, resume: bool, rank: int, bank, opt, sched, stage: str, log=print,
                    plan: TrainPlan | None = None) -> int:
    """``--resume``: restore bank, optimizer (when saved) and schedule from ``ckpt``; returns the step to start
    at. Without ``--resume`` a folder that already holds a run of this stage is refused (nothing is lost). With a
    ``plan``, a checkpoint of other settings or traces is refused with the differences (only the number of steps and
    the checkpoint interval may change), and so is a finished run (nothing is overwritten)."""
    if not resume:
        if rank == 0 and ckpt.exists():
            raise ValueError(f"{ckpt.parent.parent} already holds a {stage} run; pass --resume to continue it "
                             "or choose a new --out")
        return 0
    if not ckpt.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt}")
    try:
        state = torch.load(ckpt, weights_only=False, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise ValueError(f"--resume: the checkpoint {ckpt} cannot be read ({type(e).__name__}: {e})") from None
    if plan is not None and plan.identity is not None:
        if state.get("identity") is None:
            log(f"[{stage.lower()}] note: {ckpt} records no recipe or traces identity (an older run); not checked")
        else:
            changes = identity_changes(state["identity"], plan.identity)
            if changes:
                raise ValueError(f"--resume: {ckpt.parent.parent} was trained with other settings or traces: "
                                 + "; ".join(changes) + f" (a resume may change only {', '.join(RESUMABLE_CHANGES)})")
        if state["step"] >= plan.steps and (ckpt.parent.parent / "metrics.json").exists():  # written last
            raise ValueError(f"{ckpt.parent.parent} holds a finished {stage} run of {state['step']} steps: raise the "
                             "number of steps to continue it, or choose a new --out")
    bank.load_state_dict(state["bank"])
    if state.get("opt") is not None:
        opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    log(f"[{stage.lower()}] resumed at step {state['step']}")
    return state["step"]


def resumed_extra(ckpt: Path) -> dict:
    """The ``extra`` a stage saved with its last checkpoint (its latest metrics), for a resumed run."""
    if not ckpt.exists():
        return {}
    return torch.load(ckpt, weights_only=False, map_location="cpu").get("extra") or {}


def full_state_dict(bank, engine) -> dict:
    """The bank's full weights; under ZeRO-3 the partitions are gathered (a collective: call on every rank)."""
    if engine is not None and engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(bank.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in bank.state_dict().items()}
    return {k: v.detach().clone() for k, v in bank.state_dict().items()}


# ------------------------------------------------------------------------------------------------ steps
def optimizer_step(loss, bank, opt, engine, grad_clip: float) -> None:
    """Backward and one optimiser step, through DeepSpeed when it wraps the bank (it averages the gradients of
    the processes and clips by its config) or directly with gradient clipping."""
    if engine is not None:
        engine.backward(loss)
        engine.step()
        return
    opt.zero_grad(set_to_none=True)
    loss.backward()
    _clipped_step(bank, opt, grad_clip)


def _clipped_step(bank, opt, grad_clip: float) -> None:
    """The gradients accumulated in ``bank`` clipped to norm ``grad_clip``, then one optimiser step."""
    torch.nn.utils.clip_grad_norm_(bank.parameters(), grad_clip)
    opt.step()


def mean_step(items, loss_of, bank, opt, engine, grad_clip: float) -> list:
    """One optimiser step on the mean over ``items`` of ``loss_of(item) -> (loss, extra)``; returns each item's
    ``(detached loss, extra)``. Outside DeepSpeed each item's loss is backpropagated as it comes (scaled by
    ``1/len(items)``), so only one item's graph is alive at a time — the peak memory of one item, not of the whole
    batch — and the gradient is that of the mean (up to float summation order). Under DeepSpeed, whose engine takes one
    backward per step, the losses are stacked into the mean first."""
    if engine is not None:
        out = [loss_of(item) for item in items]
        optimizer_step(torch.stack([loss for loss, _ in out]).mean(), bank, opt, engine, grad_clip)
        return [(loss.detach(), extra) for loss, extra in out]
    opt.zero_grad(set_to_none=True)
    out = []
    for item in items:
        loss, extra = loss_of(item)
        (loss / len(items)).backward()
        out.append((loss.detach(), extra))
    _clipped_step(bank, opt, grad_clip)
    return out


def save_progress(step: int, plan: TrainPlan, module, opt, sched, engine, ckpt: Path, rank: int,
                  extra: dict | None = None, snapshot=None) -> dict | None:
    """Every ``ckpt_every`` steps and at the end: the resumable state (with the run's identity and the stage's
    ``extra``, e.g. its latest metrics), written atomically by rank 0. Call on every rank. Returns the full weights
    it saved (None when no checkpoint was due). With ``plan.snapshots``, ``snapshot(weights)`` (a
    :func:`save_snapshot`) runs first, so a job killed between the two redoes the step and writes its snapshot."""
    if (step + 1) % plan.ckpt_every == 0 or step + 1 == plan.steps:
        weights = full_state_dict(module, engine)  # collective under ZeRO-3: every rank takes part
        if rank == 0:
            if plan.snapshots and snapshot is not None:
                snapshot(weights)
            # under DeepSpeed the Adam moments live in its partitions: a resumed DeepSpeed run restarts them
            atomic.torch_save({"bank": weights, "opt": opt.state_dict() if engine is None else None,
                               "sched": sched.state_dict(), "step": step + 1, "identity": plan.identity,
                               "extra": extra or {}}, ckpt)
        return weights
    return None


def _save_standalone(path: Path, bank, model, recipe, stage: str, metrics: dict, extra: dict,
                     weights: dict | None = None) -> Path:
    """The standalone scorer checkpoint of ``bank`` in ``path``, described by the LLM and the recipe's cache settings."""
    settings = recipe.cache
    return save_scorer(bank, path, describe(model) | {"revision": recipe.model.revision, "path": recipe.model.path,
                                                      "gguf_file": recipe.model.gguf_file},
                       settings.budget, settings.interval, settings.sinks, stage, metrics, extra=extra, weights=weights)


def save_snapshot(out: Path, step: int, weights: dict, bank, model, recipe, stage: str, metrics: dict,
                  extra: dict) -> Path:
    """With the stage's ``snapshots: true``, at each checkpoint (rank 0): the scorers as they are after ``step``
    optimiser steps, as a standalone checkpoint in ``OUT/steps/step-NNNNNN`` — so a run's curve can be measured on
    held-out problems (``foresight eval --scorers OUT/steps/step-000005 --scorers ...``), not only on its few
    validation traces. ``weights``: the full weights :func:`save_progress` returned; ``metrics``: the step's own
    (reward, KL, ...)."""
    return _save_standalone(out / "steps" / f"step-{step:06d}", bank, model, recipe, stage,
                            {"step": step, **metrics}, extra | {"snapshot_of": str(out), "step": step}, weights)


def finish_run(out: Path, rank: int, world: int, weights: dict, bank, model, recipe, stage: str, metrics: dict,
               extra: dict, writer, log) -> None:
    """End of a training stage: every rank's final weights (multi-process runs, so agreement can be checked),
    then on rank 0 the standalone scorer checkpoint, ``metrics.json`` and the TensorBoard writer's close."""
    if world > 1:
        (out / "ckpt").mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous().cpu() for k, v in weights.items()},
                  str(out / "ckpt" / f"final-rank{rank}.safetensors"))
    if rank == 0:
        _save_standalone(out, bank, model, recipe, stage, metrics, extra)
        atomic.write_json(out / "metrics.json", metrics, indent=1)
        if writer is not None:
            writer.close()
        log(f"[{stage}] done: {json.dumps(metrics)}")
    distributed.barrier()


# ------------------------------------------------------------------------------------------------ logging
def summary_writer(out: Path, rank: int):
    """The run's TensorBoard writer (``OUT/tb``) on rank 0; None on the other ranks."""
    if rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out / "tb"))


def progress_bar(start: int, steps: int, desc: str, progress: bool, rank: int):
    """The tqdm bar over the training steps ``start .. steps − 1`` (shown on rank 0 when ``progress``)."""
    from tqdm import tqdm

    return tqdm(range(start, steps), desc=desc, disable=not progress or rank != 0, initial=start, total=steps)
