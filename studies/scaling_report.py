"""The data-scaling study's report (:mod:`studies.data_scaling`): per budget, each size's held-out loss ratio with its
95% interval, paired against the scorer trained on 264 traces (``Scaling.reference``) and against the best heuristic,
the validation metrics SFT ended with, the headline check (:mod:`studies.scaling_headline`), and the figure (loss ratio
against training traces, log x-axis, interval bands, the best heuristic and golden eviction as horizontal lines)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from foresight.runtime import atomic
from studies.realbench.goals import paired_ci
from studies.realbench.report import git_commit, machine
from studies.realbench.run import trained
from studies.scaling_convergence import convergence_lines, convergence_rows
from studies.scaling_headline import budgets as study_budgets
from studies.scaling_headline import headline_lines, headline_rows, interval, result_rows


def collect(study) -> dict:
    """{budget: {"methods": {name: row}, "sizes": [(run, traces, row, metrics)]}} from the study's evaluations."""
    out: dict[int, dict] = {}
    for row in result_rows(study.out / "eval-methods"):
        out.setdefault(row["budget"], {"methods": {}, "sizes": []})["methods"][row["method"]] = row
    for name, n, _ in study.runs():
        metrics_file = study.out / name / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
        for row in result_rows(study.out / f"eval-{name}"):
            if row["method"] != "full":
                out.setdefault(row["budget"], {"methods": {}, "sizes": []})["sizes"].append((name, n, row, metrics))
    return out


def best_heuristic(methods: dict) -> dict | None:
    rows = [r for m, r in methods.items() if m not in ("full", "golden") and r.get("loss_ratio") is not None]
    return min(rows, key=lambda r: r["loss_ratio"]) if rows else None


def _cell(value, ci, nd: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:.{nd}f}" + (f" [{ci[0]:+.{nd}f}, {ci[1]:+.{nd}f}]" if ci else "")


def on_curve(name: str, n: int) -> bool:
    """Whether a run is one of the curve's sizes (``sft-N``), not the wider scorer or the steps' control."""
    return name == f"sft-{n}"


def budget_table(budget: int, data: dict, reference: int) -> list[str]:
    ref = next((r for name, n, r, _ in data["sizes"] if n == reference and on_curve(name, n)), None)
    best = best_heuristic(data["methods"])
    head = f"Best heuristic: {best['method']} {interval(best)}" if best else "No heuristic rows"
    if "golden" in data["methods"]:
        head += f"; golden: {interval(data['methods']['golden'])}"
    lines = [f"### B = {budget}", "", head + ".", "",
             f"| run | training traces | loss ratio [95%] | − {reference} traces (paired) | − best heuristic (paired) | "
             "val recall@L | val loss |", "|---|---:|---|---|---|---:|---:|"]
    for name, n, row, metrics in data["sizes"]:
        vs_ref = paired_ci(row, ref) if ref is not None and row is not ref else None
        vs_best = paired_ci(row, best) if best is not None else None
        lines.append(f"| {name} | {n} | {interval(row)} | {_cell(_diff(row, ref), vs_ref)} | "
                     f"{_cell(_diff(row, best), vs_best)} | {metrics.get('val_recall_at_L', '—')} | "
                     f"{metrics.get('val_loss', '—')} |")
    return lines + [""] + contrast_lines(data["sizes"]) + [""]


def contrast_lines(sizes: list) -> list[str]:
    """The steps' control against the reference size (more steps, the same data) and against the largest size (more
    data, the same steps), and the wider scorer against the largest size; each paired."""
    runs = {name: (n, row, metrics) for name, n, row, metrics in sizes}
    top = max((n for name, n, _, _ in sizes if on_curve(name, n)), default=None)
    lines = []

    def contrast(text: str, a: str, b: str) -> None:
        if a in runs and b in runs:
            ra, rb = runs[a][1], runs[b][1]
            lines.append(f"{text}: {a} − {b} (paired): {_cell(_diff(ra, rb), paired_ci(ra, rb))}.")

    for name, (n, _, metrics) in runs.items():
        if on_curve(name, n) or name.endswith("-wide"):
            continue
        steps, base = metrics.get("steps"), runs.get(f"sft-{n}", (None, None, {}))[2].get("steps")
        contrast(f"More steps at {n} traces ({steps} against {base})", name, f"sft-{n}")
        for m, (k, _, other) in runs.items():  # the sizes trained for as many steps
            if on_curve(m, k) and k != n and other.get("steps") == steps:
                contrast(f"More data at {steps} steps ({k} traces against {n})", m, name)
    contrast(f"A wider scorer at {top} traces", f"sft-{top}-wide", f"sft-{top}")
    curve = sorted(n for name, n, _, _ in sizes if on_curve(name, n))
    if len(curve) > 1:  # below 0 by its interval: the curve still falls at its end
        contrast(f"The curve's last step ({curve[-1]} traces against {curve[-2]})", f"sft-{curve[-1]}",
                 f"sft-{curve[-2]}")
    return lines


def _diff(a: dict, b: dict | None):
    return None if b is None or a is b else a["loss_ratio"] - b["loss_ratio"]


def figure(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4), squeeze=False)
    for ax, (budget, d) in zip(axes[0], sorted(data.items())):
        pts = sorted((n, r) for name, n, r, _ in d["sizes"] if on_curve(name, n))
        if pts:
            xs = [n for n, _ in pts]
            ax.plot(xs, [r["loss_ratio"] for _, r in pts], "o-", color="C0", label="learned scorer (SFT)")
            if all(r.get("loss_ratio_ci") for _, r in pts):
                ax.fill_between(xs, [r["loss_ratio_ci"][0] for _, r in pts], [r["loss_ratio_ci"][1] for _, r in pts],
                                color="C0", alpha=0.2)
        for name, n, r, metrics in d["sizes"]:
            if not on_curve(name, n):
                wide = name.endswith("wide")
                ax.errorbar([n], [r["loss_ratio"]], fmt="s" if wide else "^", color="C3" if wide else "C2",
                            label="wider scorer" if wide else f"{n} traces, {metrics.get('steps')} steps",
                            yerr=[[r["loss_ratio"] - r["loss_ratio_ci"][0]], [r["loss_ratio_ci"][1] - r["loss_ratio"]]]
                            if r.get("loss_ratio_ci") else None)
        best = best_heuristic(d["methods"])
        if best is not None:
            ax.axhline(best["loss_ratio"], color="0.4", ls="--", label=f"best heuristic ({best['method']})")
        if "golden" in d["methods"]:
            ax.axhline(d["methods"]["golden"]["loss_ratio"], color="k", ls=":", label="golden (sees the future)")
        ax.set_xscale("log")
        ax.set_xlabel("training traces")
        ax.set_ylabel("held-out loss ratio (lower is better)")
        ax.set_title(f"B = {budget}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cost_lines(study) -> list[str]:
    """What each stage cost on this machine: the seconds per stage (summed over resumed runs), the traces' last run
    and each SFT run's training time."""
    from studies.realbench.run import stage_times

    lines = ["## Cost", "", "| stage | seconds | what |", "|---|---:|---|"]
    meta = study.out / "traces" / "meta.json"
    tp = json.loads(meta.read_text()).get("throughput", {}) if meta.exists() else {}
    for stage, seconds in stage_times(study.out).items():
        what = {"golden": f"golden examples of the largest size's {max(study.sizes)} training and {study.val} "
                          "validation traces", "eval": f"{study.problems} held-out references: the methods, then "
                                                       "every scorer",
                "headline": "the heuristics and the best point at 2B, the allocation's runs",
                "val": "every run's validation curve from its snapshots"}.get(stage, "")
        if stage == "traces" and tp:
            what = (f"its last run: {tp.get('requests_this_run', '?')} prompts decoded, "
                    f"{tp.get('generated_tokens_this_run', '?')} new tokens, {tp.get('kept_this_run', '?')} traces "
                    "kept and scored")
        lines.append(f"| {stage} | {seconds} | {what} |")
    for name, n, _ in study.runs():
        f = study.out / name / "metrics.json"
        if f.exists():
            m = json.loads(f.read_text())
            lines.append(f"| sft {name} | {m.get('train_seconds_this_run', '—')} | {m.get('steps', '—')} steps on {n} "
                         "traces (the last run's training time, when resumed) |")
    return lines + [""]


def coverage_lines(study, data: dict) -> list[str]:
    """What the report does not hold yet (a study still running): the runs not trained, not evaluated at every
    budget, and the methods' evaluation; nothing once the study is complete."""
    budgets = [b for b, _ in study_budgets(study)]
    untrained = [name for name, _, _ in study.runs() if not trained(study.out / name)]
    unevaluated = [name for name, _, _ in study.runs() if name not in untrained and not all(
        any(r[0] == name for r in data.get(b, {}).get("sizes", [])) for b in budgets)]
    missing = [f"not trained yet: {', '.join(untrained)}"] if untrained else []
    missing += [f"not evaluated yet: {', '.join(unevaluated)}"] if unevaluated else []
    if not all(data.get(b, {}).get("methods") for b in budgets):
        missing.append("the heuristics and golden are not evaluated yet")
    return [f"**Incomplete:** {'; '.join(missing)}. Rerun the command: every stage resumes.", ""] if missing else []


def write_report(study) -> None:
    data = collect(study)
    study.report.mkdir(parents=True, exist_ok=True)
    atomic.write_json(study.report / "results.json", {str(b): d for b, d in data.items()}, indent=1)
    if data:
        figure(data, study.report / "scaling.png")
    converged = convergence_rows(study)
    if converged:
        atomic.write_json(study.report / "convergence.json", converged, indent=1)
    headline = headline_rows(study)
    if headline.get("allocated_runs"):
        atomic.write_json(study.report / "headline.json", headline, indent=1)
    sizes = ",".join(str(n) for n in study.sizes)
    lines = [f"# How far data takes the scorer: SFT on {min(study.sizes):,} to {max(study.sizes):,} training traces", "",
             f"- **Command:** `python -m studies.data_scaling --out {study.out} --report {study.report} --sizes {sizes}"
             f" --val {study.val} --problems {study.problems} --budgets {study.budgets}`",
             f"- **Commit:** {git_commit()}", f"- **Date:** {datetime.date.today().isoformat()}",
             f"- **Machine:** {machine()}", "",
             f"Every run: the realbench recipe's scorer and SFT settings on the first N of one folder's training traces "
             f"(its last {study.val} traces validate every run), steps in proportion to N (at least half the recipe's); "
             f"the {study.reference}-trace size again at the largest size's steps, which separates the steps' share of "
             "the curve from the data's; each "
             f"evaluated on the same {study.problems} held-out references. Paired columns: the difference of loss "
             "ratios on the same traces with its 95% bootstrap interval.", "",
             "The references are the realbench's held-out prompts with its sampling settings and seeds, generated in "
             "the study's own cache: every row here (heuristics, golden, each scorer) is on the same references, but "
             "references drawn in other generation batches differ in bfloat16, so these rows pair with each other, not "
             "with other evaluations' rows.", ""] + coverage_lines(study, data) + (
                ["![scaling](scaling.png)", ""] if data else [])
    for budget in sorted(data):
        lines += budget_table(budget, data[budget], study.reference)
    lines += convergence_lines(study) + headline_lines(study) + cost_lines(study)
    (study.report / "README.md").write_text("\n".join(lines))
