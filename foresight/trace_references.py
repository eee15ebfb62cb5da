"""Validation traces as evaluation references (``foresight eval --traces DIR``, ``eval.traces``).

Evaluation settings (a sampler's temperature, a budget's interval) chosen on the held-out references tune to the test
set. A traces folder's validation split (its last ``sft.val_traces`` traces, the ones SFT held out: at most a quarter,
as in training) are full-cache traces the scorers were not trained on, with their per-token loss and entropy already
stored: they are teacher-forced exactly like generated references, and nothing is generated. A scorer trained on the
same folder with fewer validation traces would be evaluated on its own training traces: that is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from foresight import prompts
from foresight.checkpoint import read_config
from foresight.trace_data import load_traces
from foresight.training import check_traces_model, split_traces


def _same_folder(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, TypeError):
        return False


def check_scorers_unseen(traces_dir: Path, held_out: int, scorers) -> None:
    """Refuse a scorer trained on ``traces_dir`` that held out fewer than its last ``held_out`` traces."""
    for d in scorers:
        cfg = read_config(d)
        if not _same_folder(cfg.get("training_data", ""), traces_dir):
            continue
        metrics = cfg.get("metrics") or {}
        stage = cfg.get("stage", "sft")
        section = (cfg.get("recipe") or {}).get("grpo" if stage == "grpo" else "sft") or {}
        kept_out = metrics.get("val_traces", section.get("val_traces", 2))
        if kept_out < held_out:
            raise ValueError(f"the scorer {d} was trained on {traces_dir} holding out only its last {kept_out} traces: "
                             f"evaluating on the last {held_out} would include its training traces (set "
                             f"sft.val_traces <= {kept_out}, or eval.num_problems <= {kept_out})")


def validation_references(recipe, traces_dir, model, device, scorers=()) -> tuple[list, list[dict]]:
    """The validation traces of ``traces_dir`` (the last ``sft.val_traces``, at most ``eval.num_problems`` of them) as
    (prompts, references): references in :func:`foresight.references.reference_traces`' form (``ids`` [1, S],
    ``prompt_len``, full-cache ``loss`` and ``entropy`` [S], ``correct``), prompts rebuilt from each trace's
    ``prompt_index`` (for accuracy, when the task has a checker)."""
    ds = load_traces(traces_dir)
    check_traces_model(ds, traces_dir, recipe, model)
    _, val_idx = split_traces(len(ds), recipe.sft.val_traces)
    if not val_idx:
        raise ValueError(f"{traces_dir} has no validation traces: sft.val_traces={recipe.sft.val_traces} of "
                         f"{len(ds)} traces (at most a quarter are held out)")
    val_idx = val_idx[:recipe.eval.num_problems]
    check_scorers_unseen(Path(traces_dir), len(ds) - val_idx[0], scorers)
    rows = [ds[i] for i in val_idx]
    indices = [row.get("prompt_index", i) for row, i in zip(rows, val_idx)]
    by_index = {}  # the prompts behind the traces, read in one pass over the prompt source
    if recipe.task.kind != "none":
        lo = min(indices)
        by_index = {p.index: p for p in prompts.load_prompts(recipe, lo, max(indices) - lo + 1, split="train")}
    problems, refs = [], []
    for row, index in zip(rows, indices):
        problems.append(by_index.get(index) or prompts.Prompt(index, [], row.get("answer")))
        refs.append({"ids": torch.tensor([row["input_ids"]], device=device), "prompt_len": int(row["prompt_len"]),
                     "loss": torch.tensor(row["token_loss"], dtype=torch.float32, device=device),
                     "entropy": torch.tensor(row["token_entropy"], dtype=torch.float32, device=device),
                     "correct": row.get("correct")})
    return problems, refs

