"""Validation traces as evaluation references (``foresight eval --traces DIR``, ``eval.traces``).

Evaluation settings (a sampler's temperature, a budget's interval) chosen on the held-out references tune to the test
set. A traces folder's validation split (its last ``sft.val_traces`` traces, the ones SFT held out: at most a quarter,
as in training) are full-cache traces the scorers were not trained on, with their per-token loss and entropy already
stored: they are teacher-forced exactly like generated references, and nothing is generated. A scorer trained on the
same folder with fewer validation traces would be evaluated on its own training traces: that is refused — by content
when the scorer's checkpoint records the fingerprints of its training traces (:func:`check_references_unseen`, for
held-out references too), else by the folder's path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from foresight.data import prompts
from foresight.scorers.checkpoint import read_config
from foresight.data.trace_data import fingerprint, load_traces
from foresight.data.stage_inputs import check_traces_model, split_traces


def _same_folder(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, TypeError):
        return False


def check_scorers_unseen(traces_dir: Path, held_out: int, scorers) -> None:
    """Refuse a scorer trained on ``traces_dir`` that held out fewer than its last ``held_out`` traces (scorers from
    before checkpoints recorded their traces' fingerprints; the others are checked by content)."""
    for d in scorers:
        cfg = read_config(d)
        if cfg.get("training_traces") or not _same_folder(cfg.get("training_data", ""), traces_dir):
            continue
        metrics = cfg.get("metrics") or {}
        stage = cfg.get("stage", "sft")
        section = (cfg.get("recipe") or {}).get("grpo" if stage == "grpo" else "sft") or {}
        kept_out = metrics.get("val_traces", section.get("val_traces", 2))
        if kept_out < held_out:
            raise ValueError(f"the scorer {d} was trained on {traces_dir} holding out only its last {kept_out} traces: "
                             f"evaluating on the last {held_out} would include its training traces (set "
                             f"sft.val_traces <= {kept_out}, or eval.num_problems <= {kept_out})")


def check_references_unseen(refs: list[dict], scorers, log=print) -> dict[str, int]:
    """Refuse a scorer whose checkpoint records one of ``refs`` (by the fingerprint of its tokens) among its training
    traces; returns, per scorer that records them, how many references have a prompt it was trained on (logged when
    any: another sample of a training prompt is not a held-out problem)."""
    shared = {}
    if not scorers:
        return shared
    ref_prints = [(fingerprint(r["ids"][0].tolist()), fingerprint(r["ids"][0, :r["prompt_len"]].tolist())) for r in refs]
    for d in scorers:
        seen = read_config(d).get("training_traces")
        if not seen:
            continue
        traces, prompts_seen = set(seen.get("traces", [])), set(seen.get("prompts", []))
        trained_on = [i for i, (t, _) in enumerate(ref_prints) if t in traces]
        if trained_on:
            raise ValueError(f"the scorer {d} was trained on {len(trained_on)} of the {len(refs)} evaluation traces "
                             f"(references {trained_on[:8]}{' ...' if len(trained_on) > 8 else ''}): evaluate it on "
                             "traces it did not see (another traces folder or split, or the held-out references)")
        shared[str(d)] = sum(p in prompts_seen for _, p in ref_prints)
        if shared[str(d)]:
            log(f"[eval] note: {shared[str(d)]} of the {len(refs)} references have a prompt the scorer {d} was "
                "trained on (other samples of it)")
    return shared


def validation_references(recipe, traces_dir, model, device, scorers=(), log=print) -> tuple[list, list[dict]]:
    """The validation traces of ``traces_dir`` (the last ``sft.val_traces``, at most ``eval.num_problems`` of them) as
    (prompts, references): references in :func:`foresight.data.references.reference_traces`' form (``ids`` [1, S],
    ``prompt_len``, full-cache ``loss`` and ``entropy`` [S], ``correct``), prompts rebuilt from each trace's
    ``prompt_index`` (for accuracy, when the task has a checker). SFT's split holds out at most a quarter of a folder;
    when that caps ``sft.val_traces``, ``log`` says so (a search on 8 traces where 32 were asked for is easy to miss)."""
    ds = load_traces(traces_dir)
    check_traces_model(ds, traces_dir, recipe.model, model)
    _, val_idx = split_traces(len(ds), recipe.sft.val_traces)
    if not val_idx:
        raise ValueError(f"{traces_dir} has no validation traces: sft.val_traces={recipe.sft.val_traces} of "
                         f"{len(ds)} traces (at most a quarter are held out)")
    if len(val_idx) < min(recipe.sft.val_traces, recipe.eval.num_problems):
        log(f"[validation] sft.val_traces={recipe.sft.val_traces}, but SFT's split holds out at most a quarter of the "
            f"{len(ds)} traces in {traces_dir}: {len(val_idx)} validation traces (for {recipe.sft.val_traces}, a "
            f"folder of {4 * recipe.sft.val_traces} traces)")
    val_idx = val_idx[:recipe.eval.num_problems]
    check_scorers_unseen(Path(traces_dir), len(ds) - val_idx[0], scorers)
    rows = [ds[i] for i in val_idx]
    indices = [row.get("prompt_index", i) for row, i in zip(rows, val_idx)]
    by_index = {}  # the prompts behind the traces, read in one pass over the prompt source
    if recipe.task.kind != "none":
        read = prompts.load_rows(recipe.task, recipe.traces, sorted(set(indices)), split="train")
        by_index = {p.index: p for p in read}
    problems, refs = [], []
    for row, index in zip(rows, indices):
        problems.append(by_index.get(index) or prompts.Prompt(index, [], row.get("answer")))
        refs.append({"ids": torch.tensor([row["input_ids"]], device=device), "prompt_len": int(row["prompt_len"]),
                     "loss": torch.tensor(row["token_loss"], dtype=torch.float32, device=device),
                     "entropy": torch.tensor(row["token_entropy"], dtype=torch.float32, device=device),
                     "correct": row.get("correct")})
    return problems, refs

