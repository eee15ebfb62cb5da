"""Plumbing shared by the scorer-training stages — ForesightKV's SFT (:mod:`foresight.training.sft`) and GRPO
(:mod:`foresight.training.grpo.stage`), and KVpop's boundary-loss training (:mod:`foresight.training.kvpop`): the plan,
the setup and ``--resume``. The optimiser steps and the resumable state are :mod:`foresight.training.steps`; the
standalone checkpoints, the end of a run and its logging :mod:`foresight.training.outputs`.

* **Inputs** (:mod:`foresight.data.stage_inputs`): the device, the frozen LLM, the traces and their train/validation split.
* **Plan** (:class:`TrainPlan`, :func:`train_plan`): what the plumbing reads from a recipe section — optimiser,
  schedule (linear warm-up, then cosine or constant: :func:`lr_lambda`), checkpoint interval, DeepSpeed.
* **Setup** (:func:`setup_training`): Adam, the schedule, ``--resume`` from ``OUT/ckpt/state.pt``
  (:func:`load_checkpoint` into a :class:`TrainState`; a folder that already holds a run is refused without it) and
  the DeepSpeed engine.

Under ZeRO-3 the scorers stay whole on every rank (see :func:`_deepspeed_engine`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from foresight.runtime import distributed


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


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a run's resumable checkpoint holds and where: the trained ``module``, its optimiser ``opt`` and schedule
    ``sched``, the checkpoint file ``ckpt`` (``OUT/ckpt/state.pt``) and the DeepSpeed ``engine`` when one wraps the
    module (None before it does, and without DeepSpeed)."""

    module: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: object
    ckpt: Path
    engine: object = None


def setup_training(module, plan: TrainPlan, out: Path, resume: bool, rank: int, deepspeed_config, stage: str, log):
    """Adam + the warm-up/cosine (or constant) schedule for ``module``, the run's checkpoint (restored with
    ``--resume``, before DeepSpeed wraps anything: ZeRO partitions what is loaded) and the DeepSpeed engine when
    configured. Returns (opt, sched, ckpt path, first step, engine or None)."""
    opt = torch.optim.Adam(module.parameters(), lr=plan.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, plan.warmup, plan.steps, plan.schedule))
    ckpt = out / "ckpt" / "state.pt"
    start = load_checkpoint(TrainState(module, opt, sched, ckpt), resume, rank, stage, log, plan)
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
def load_checkpoint(state: TrainState, resume: bool, rank: int, stage: str, log=print,
                    plan: TrainPlan | None = None) -> int:
    """``--resume``: restore ``state``'s module, optimizer (when saved) and schedule from its ``ckpt`` (before
    DeepSpeed wraps them); returns the step to start at. Without ``--resume`` a folder that already holds a run of
    this stage is refused (nothing is lost). With a ``plan``, a checkpoint of other settings or traces is refused with
    the differences (only the number of steps and the checkpoint interval may change), and so is a finished run
    (nothing is overwritten)."""
    ckpt, bank, opt, sched = state.ckpt, state.module, state.opt, state.sched
    if not resume:
        if rank == 0 and ckpt.exists():
            raise ValueError(f"{ckpt.parent.parent} already holds a {stage} run; pass --resume to continue it "
                             "or choose a new --out")
        return 0
    if not ckpt.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt}")
    try:
        saved = torch.load(ckpt, weights_only=False, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise ValueError(f"--resume: the checkpoint {ckpt} cannot be read ({type(e).__name__}: {e})") from None
    if plan is not None and plan.identity is not None:
        if saved.get("identity") is None:
            log(f"[{stage.lower()}] note: {ckpt} records no recipe or traces identity (an older run); not checked")
        else:
            changes = identity_changes(saved["identity"], plan.identity)
            if changes:
                raise ValueError(f"--resume: {ckpt.parent.parent} was trained with other settings or traces: "
                                 + "; ".join(changes) + f" (a resume may change only {', '.join(RESUMABLE_CHANGES)})")
        if saved["step"] >= plan.steps and (ckpt.parent.parent / "metrics.json").exists():  # written last
            raise ValueError(f"{ckpt.parent.parent} holds a finished {stage} run of {saved['step']} steps: raise the "
                             "number of steps to continue it, or choose a new --out")
    bank.load_state_dict(saved["bank"])
    if saved.get("opt") is not None:
        opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    log(f"[{stage.lower()}] resumed at step {saved['step']}")
    return saved["step"]


def resumed_extra(ckpt: Path) -> dict:
    """The ``extra`` a stage saved with its last checkpoint (its latest metrics), for a resumed run."""
    if not ckpt.exists():
        return {}
    return torch.load(ckpt, weights_only=False, map_location="cpu").get("extra") or {}


