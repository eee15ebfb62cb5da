"""The training stages' optimiser steps and resumable state (the plan and setup: :mod:`foresight.training.runs`).

* **Steps** (:func:`optimizer_step`, :func:`mean_step`): backward and one optimiser step (through DeepSpeed when it
  wraps the scorers; :func:`mean_step` frees each item's graph before the next).
* **Progress** (:func:`save_progress`): the resumable state every ``ckpt_every`` steps and at the end, written
  atomically (:func:`foresight.runtime.atomic.torch_save`) by rank 0.

Under ZeRO-3 the scorers stay whole on every rank (:func:`foresight.training.runs._deepspeed_engine`);
:func:`full_state_dict` gathers them all the same, a collective that every rank must call.
"""

from __future__ import annotations

import torch

from foresight.runtime import atomic
from foresight.training.runs import TrainPlan, TrainState


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


def save_progress(step: int, plan: TrainPlan, state: TrainState, rank: int, extra: dict | None = None,
                  snapshot=None) -> dict | None:
    """Every ``ckpt_every`` steps and at the end: the resumable state of ``state`` (its module's weights, optimiser
    and schedule, with the run's identity and the stage's ``extra``, e.g. its latest metrics) in its ``ckpt``,
    written atomically by rank 0. Call on every rank. Returns the full weights
    it saved (None when no checkpoint was due). With ``plan.snapshots``, ``snapshot(weights)`` (a
    :func:`save_snapshot`) runs first, so a job killed between the two redoes the step and writes its snapshot."""
    module, opt, sched, engine, ckpt = state.module, state.opt, state.sched, state.engine, state.ckpt
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

