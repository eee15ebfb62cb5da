"""Whether each run of the data-scaling study (:mod:`studies.data_scaling`, stage ``val``) trained to convergence on
its validation traces: SFT's own validation (the lost-future ratio and the hinge loss on golden's states of the
study's validation traces, :func:`foresight.training.sft.validation_scores`) at every snapshot the run kept, stored
per trace in ``OUT/<run>/val_curve.json`` (a killed stage keeps the steps it finished). The report pairs the finished
run against its snapshot at half its steps over the same traces: a difference whose interval lies below 0 means the
run was still learning in its second half (under a cosine schedule, partly the learning rate's decay)."""

from __future__ import annotations

import json
from pathlib import Path

from foresight.runtime import atomic
from foresight.evaluation.paired import paired_diff_ci
from studies.realbench.run import banner, trained

CURVE = "val_curve.json"


def snapshot_steps(folder: Path) -> list[tuple[int, Path]]:
    """(step, checkpoint) of every snapshot a run kept, the finished run's own last."""
    snaps = sorted((int(p.name.removeprefix("step-")), p) for p in (folder / "steps").glob("step-*")
                   if (p / "config.json").exists())
    if trained(folder):
        steps = json.loads((folder / "metrics.json").read_text())["steps"]
        snaps = [(s, p) for s, p in snaps if s != steps] + [(steps, folder)]
    return snaps


def validation_curves(study) -> None:
    """Every run's validation curve, computing only the steps its ``val_curve.json`` lacks."""
    import torch

    from foresight.data.stage_inputs import load_stage_inputs
    from foresight.scorers.checkpoint import load_scorer
    from foresight.training.sft import golden_stores, training_settings, validation_scores

    recipe = study.recipe(f"sft.train_traces={max(study.sizes)}")
    _, model, ds, _, val_idx = load_stage_inputs(recipe.sft, recipe.model, study.out / "traces", 1)
    stores, settings = golden_stores(recipe, model), training_settings(recipe)
    if not stores:
        raise ValueError("the validation curves read the stored golden examples: sft.example_steps must be > 0")
    for name, _, _ in study.runs():
        folder = study.out / name
        path = folder / CURVE
        curve = json.loads(path.read_text()) if path.exists() else {}
        todo = [(s, p) for s, p in snapshot_steps(folder) if str(s) not in curve]
        if todo:
            banner(f"validation curve {name}: {len(todo)} snapshots")
        for step, ckpt in todo:
            bank, _ = load_scorer(ckpt, model)
            groups = ([(s.interval, st.examples(ds[i], bank)) for s, st in zip(settings, stores)] for i in val_idx)
            with torch.no_grad():
                per, lost = validation_scores(bank, groups, recipe.sft)
            curve[str(step)] = {"lost_future": [round(x, 6) for x in lost],
                                "loss": [round(torch.stack([p[0] for p in t]).mean().item(), 6) for t in per]}
            atomic.write_json(path, dict(sorted(curve.items(), key=lambda kv: int(kv[0]))), indent=1)


def convergence_rows(study) -> list[dict]:
    """Per run: its validation metrics at half its steps and at the end, and the paired difference end − half."""
    rows = []
    for name, n, _ in study.runs():
        path = study.out / name / CURVE
        if not path.exists() or not trained(study.out / name):  # a run still training has no end yet
            continue
        curve = {int(k): v for k, v in json.loads(path.read_text()).items()}
        end = max(curve)
        half = min(curve, key=lambda s: abs(s - end / 2))
        if half == end:
            continue
        row = {"run": name, "traces": n, "steps": end, "half": half}
        for metric in ("lost_future", "loss"):
            a, b = curve[end][metric], curve[half][metric]
            row[metric] = (sum(a) / len(a), sum(b) / len(b), paired_diff_ci(b, None, a, None))  # end − half
        rows.append(row)
    return rows


def curves_figure(study, path: Path) -> bool:
    """Every run's validation lost-future ratio against its steps (mean over the validation traces), one line per run:
    runs of different data at the same step read off one vertical. False when no run has a curve."""
    curves = {name: json.loads((study.out / name / CURVE).read_text()) for name, _, _ in study.runs()
              if (study.out / name / CURVE).exists()}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, curve in curves.items():
        steps = sorted(int(k) for k in curve)
        ax.plot(steps, [sum(curve[str(k)]["lost_future"]) / len(curve[str(k)]["lost_future"]) for k in steps], "o-",
                ms=3, label=name + ("" if trained(study.out / name) else " (training)"))
    ax.set_xlabel("SFT step")
    ax.set_ylabel("validation lost-future ratio (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def convergence_lines(study) -> list[str]:
    rows = convergence_rows(study)
    if not rows:
        return []
    figure = curves_figure(study, study.report / "val_curves.png")
    lines = ["## Convergence on the validation traces", ""] + (["![validation curves](val_curves.png)", ""] if figure
                                                            else []) + [
             f"SFT's own validation on the study's {study.val} validation traces (golden's states), at the run's "
             "snapshot nearest half its steps and at its end; end − half paired over the same traces (95% bootstrap "
             "interval). *Still falling*: an interval lies below 0; *rising*: one lies above 0. The learning rate "
             "decays over each run's own steps (cosine), so a fall in the second half is partly the decay's: the steps' "
             "control above (the same data, the largest size's steps, on the held-out references) is the direct test "
             "of whether a run had converged.",
             "",
             "| run | traces | steps | lost-future ratio: half → end | end − half (paired) | hinge loss: half → end | "
             "end − half (paired) | verdict |", "|---|---:|---:|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for metric in ("lost_future", "loss"):
            end, half, ci = r[metric]
            cells += [f"{half:.4f} → {end:.4f}", f"{end - half:+.4f}" + (f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "")]
        falling = any(r[m][2] and r[m][2][1] < 0 for m in ("lost_future", "loss"))
        rising = any(r[m][2] and r[m][2][0] > 0 for m in ("lost_future", "loss"))
        verdict = "still falling" if falling and not rising else "rising (past its best)" if rising and not falling \
            else "mixed" if falling else "flat"
        lines.append(f"| {r['run']} | {r['traces']} | {r['half']} → {r['steps']} | {' | '.join(cells)} | {verdict} |")
    return lines + [""]
