"""What the training stages write besides their resumable state (:mod:`foresight.training.steps`): standalone
scorer checkpoints during and at the end of a run, and its logs.

* **Snapshots** (:func:`save_snapshot`): with ``snapshots: true``, a standalone scorer checkpoint at every checkpoint
  step (``OUT/steps/step-NNNNNN``), for a held-out curve of the run.
* **End** (:func:`finish_run`): the standalone scorer checkpoint (:func:`foresight.scorers.checkpoint.save_scorer`),
  ``metrics.json``, and in multi-process runs every rank's final weights.
* **Logging** (:func:`summary_writer`, :func:`progress_bar`): TensorBoard (``OUT/tb``) and the tqdm bar, on rank 0.

Each takes the run's :class:`RunOutput`: its folder, the LLM and recipe that describe its checkpoints, the stage and
the provenance they record.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors.torch import save_file

from foresight.runtime import atomic, distributed
from foresight.scorers.checkpoint import CheckpointExtras, save_scorer
from foresight.engine.models import describe


def _save_standalone(path: Path, bank, model, recipe, stage: str, metrics: dict, extra: dict,
                     weights: dict | None = None) -> Path:
    """The standalone scorer checkpoint of ``bank`` in ``path``, described by the LLM and the recipe's cache settings."""
    settings = recipe.cache
    return save_scorer(bank, path, describe(model) | {"revision": recipe.model.revision, "path": recipe.model.path,
                                                      "gguf_file": recipe.model.gguf_file},
                       settings.budget, settings.interval, settings.sinks, stage,
                       CheckpointExtras(metrics, extra=extra, weights=weights))


@dataclasses.dataclass(frozen=True)
class RunOutput:
    """What a run's standalone checkpoints are written from: its folder ``out``, the frozen LLM ``model`` and the
    ``recipe`` (they describe the checkpoint: the LLM, the cache settings), the ``stage`` name (``sft``, ``grpo``,
    ``kvpop-...``) and the ``provenance`` keys added to each checkpoint's config (training data, initial scorers,
    recipe)."""

    out: Path
    model: object
    recipe: object
    stage: str
    provenance: dict


def save_snapshot(run: RunOutput, step: int, weights: dict, bank, metrics: dict) -> Path:
    """With the stage's ``snapshots: true``, at each checkpoint (rank 0): the scorers as they are after ``step``
    optimiser steps, as a standalone checkpoint in ``OUT/steps/step-NNNNNN`` — so a run's curve can be measured on
    held-out problems (``foresight eval --scorers OUT/steps/step-000005 --scorers ...``), not only on its few
    validation traces. ``weights``: the full weights :func:`save_progress` returned; ``metrics``: the step's own
    (reward, KL, ...)."""
    out = run.out
    return _save_standalone(out / "steps" / f"step-{step:06d}", bank, run.model, run.recipe, run.stage,
                            {"step": step, **metrics}, run.provenance | {"snapshot_of": str(out), "step": step}, weights)


def finish_run(run: RunOutput, rank: int, world: int, weights: dict, bank, metrics: dict, writer, log) -> None:
    """End of a training stage: every rank's final weights (multi-process runs, so agreement can be checked),
    then on rank 0 the standalone scorer checkpoint in ``run.out``, ``metrics.json`` and the TensorBoard writer's
    close."""
    out, stage = run.out, run.stage
    if world > 1:
        (out / "ckpt").mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous().cpu() for k, v in weights.items()},
                  str(out / "ckpt" / f"final-rank{rank}.safetensors"))
    if rank == 0:
        _save_standalone(out, bank, run.model, run.recipe, stage, metrics, run.provenance)
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
