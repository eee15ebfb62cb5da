"""The real-model benchmark's report (:mod:`studies.realbench.run`): ``results.md``, ``results.json`` and the figures,
written from what the stages left in the benchmark's folder (no model run).

The goal checks it reports are computed, not claimed (:mod:`studies.realbench.goals`).
"""

from __future__ import annotations

import json
import shutil
import os
import platform
import subprocess
import time
from pathlib import Path

from foresight.runtime import atomic
from studies.realbench.goals import goal_checks, grpo_vs_sft, paired_ci
from foresight.evaluation.report import dloss, fmt, results_table, with_ci
from foresight.evaluation.styles import method_group

FIGURES = ("overview.png", "loss_ratio.png", "loss_increase.png", "eviction_map.png")


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _ci(r: dict, key: str, nd: int = 4, cell=None) -> str:
    return with_ci(r.get(key), r.get(f"{key}_ci"), nd, cell)


def _yes(v) -> str:
    return "—" if v is None else ("yes" if v else "no")


def _compact(rows: list[dict] | None) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "per_trace"} for r in rows or []]


def paired_cell(a: dict | None, b: dict | None) -> str:
    """Loss ratio of row a minus row b with the paired 95% interval over the traces both hold; "—" for a row
    against itself or when they cannot be paired."""
    ci = None if a is None or b is None or a is b else paired_ci(a, b)
    if ci is None:
        return "—"
    return f"{a['loss_ratio'] - b['loss_ratio']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]"


def ablation_table(rows: list[dict], labels: dict[str, str]) -> str:
    """The learned rows of the ablation evaluations, each paired with the main SFT scorer on the same traces."""
    head = ("| variant | loss ratio [95% CI] | − main (paired 95% CI) | Δloss low-H [95% CI] | recall@L [95% CI] |\n"
            "|---|---|---|---|---|\n")
    main = next((r for r in rows if r["method"] == "foresight-sft"), None)
    body = ""
    for r in rows:
        if method_group(r["method"]) != "learned":
            continue
        body += (f"| {labels.get(r['method'], r['method'])} | {_ci(r, 'loss_ratio')} | {paired_cell(r, main)} | "
                 f"{_ci(r, 'low_entropy_loss_increase', cell=dloss)} | {_ci(r, 'recall_at_L', 3)} |\n")
    return head + body


def sampler_table(sampler_rows: dict[str, list[dict] | None], main_mode: str | None) -> list[str]:
    """Each learned scorer under each eviction sampler, paired with the same scorer under the main evaluation's."""
    md = ["| sampler | scorer | loss ratio [95% CI] | − " + (main_mode or "main") + " (paired 95% CI) | "
          "Δloss low-H [95% CI] |", "|---|---|---|---|---|"]
    base = {r["method"]: r for r in sampler_rows.get(main_mode) or []}
    for mode, srows in sampler_rows.items():
        for r in srows or []:
            if method_group(r["method"]) == "learned":
                md.append(f"| {mode} | {r['method']} | {_ci(r, 'loss_ratio')} | {paired_cell(r, base.get(r['method']))} "
                          f"| {_ci(r, 'low_entropy_loss_increase', cell=dloss)} |")
    return md


def _val(h: dict, key: str, nd: int = 4) -> str:
    """A validation value with its interval (``key_lo``, ``key_hi``) when recorded."""
    if h.get(key) is None:
        return "—"
    ci = f" [{fmt(h[key + '_lo'], nd)}, {fmt(h[key + '_hi'], nd)}]" if h.get(key + "_lo") is not None else ""
    return fmt(h[key], nd) + ci


def grpo_section(metrics: dict | None) -> str:
    if not metrics or not metrics.get("history"):
        return "GRPO did not run.\n"
    lines = ["| step | reward mean | reward std | |advantage| | groups without reward spread | evicted-set overlap "
             "in a group | KL to SFT | clip fraction | held-out loss ratio [95% CI] | its change since SFT [paired 95% CI] | "
             "held-out reward [95% CI] |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, h in enumerate(metrics["history"]):
        lines.append(f"| {i + 1} | {fmt(h.get('reward_mean'), 4)} | {fmt(h.get('reward_std'), 4)} | "
                     f"{fmt(h.get('adv_abs'), 3)} | {fmt(h.get('flat_groups'), 2)} | {fmt(h.get('group_overlap'), 3)} | "
                     f"{fmt(h.get('kl'), 5)} | {fmt(h.get('clip_frac'), 3)} | {_val(h, 'val_loss_ratio')} | "
                     f"{_val(h, 'val_loss_ratio_change')} | {_val(h, 'val_reward')} |")
    sft = {k[4:]: v for k, v in metrics.items() if k.startswith("sft_val_")}
    n = f"{metrics['val_traces']} " if metrics.get("val_traces") else ""
    before = (f"\nHeld-out training traces ({n}traces GRPO never trains on, top-L eviction) before GRPO, i.e. the SFT "
              f"scorer: loss ratio {_val(sft, 'val_loss_ratio')}, reward {_val(sft, 'val_reward')}; after: loss ratio "
              f"{_val(metrics, 'val_loss_ratio')}, reward {_val(metrics, 'val_reward')}.\n")
    return "\n".join(lines) + "\n" + before


def grpo_figure(metrics: dict | None, path: Path) -> bool:
    if not metrics or not metrics.get("history"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = metrics["history"]
    steps = list(range(1, len(hist) + 1))
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
    mean = [h["reward_mean"] for h in hist]
    std = [h["reward_std"] for h in hist]
    axes[0].plot(steps, mean, marker="o", color="C0")
    axes[0].fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    axes[0].set(title="training reward (mean ± std over rollouts)", xlabel="GRPO step")
    sft = {k[4:]: v for k, v in metrics.items() if k.startswith("sft_val_")}
    val = [(0, sft)] * bool(sft) + [(i + 1, h) for i, h in enumerate(hist) if "val_reward" in h]
    for ax, key, title in ((axes[1], "val_reward", "held-out reward (95% CI; step 0 = SFT)"),
                           (axes[2], "val_loss_ratio", "held-out loss ratio (95% CI)")):
        xs = [x for x, _ in val]
        ax.plot(xs, [h[key] for _, h in val], marker="o", color="C3")
        if all(h.get(key + "_lo") is not None for _, h in val) and val:
            ax.fill_between(xs, [h[key + "_lo"] for _, h in val], [h[key + "_hi"] for _, h in val], alpha=0.2, color="C3")
        ax.set(title=title, xlabel="GRPO step")
    axes[3].plot(steps, [h["kl"] for h in hist], marker="o", color="C1")
    axes[3].set(title="KL to SFT (orange) and clip fraction (green)", xlabel="GRPO step")
    clip = axes[3].twinx()
    clip.plot(steps, [h["clip_frac"] for h in hist], marker="s", color="C2")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main_label(config: dict | None) -> str:
    """The main SFT scorer in the ablation table, from its checkpoint's config (inputs, width, golden pooling)."""
    if not config:
        return "main"
    spec, sft = config.get("scorer", {}), config.get("recipe", {}).get("sft", {})
    inputs = " + ".join({"attn": "attention"}.get(f, f) for f in spec.get("features", ()))
    return f"main: {inputs}, width {spec.get('hidden', '?')}, {sft.get('golden_pool', 'mean')} pooling"


def predictability_section(pred: dict | None) -> list[str]:
    """The recall@L that the past allows (studies.realbench.predictability's summary), beside the scorers' recall@L."""
    if not pred:
        return []
    ident = pred["identity"]
    md = ["\n**How much of golden's choice the past decides** (`python -m studies.realbench.predictability`: at position "
          f"{ident['position']} of {ident['probe']['problems']} held-out references, {ident['probe']['continuations']} "
          "more continuations of the same prefix sampled like the references; golden's L evictions under each "
          "continuation's future against those under the reference's own. *Ceiling*: the L candidates golden drops "
          "most often across the continuations — an estimate, rising with K, of the best recall@L any scorer that sees "
          "only the past can reach at this state; *scorer*: "
          f"`{ident['scorer'] or '—'}` at the same states):\n",
          "| states | B:L | traces | two futures agree | ceiling, K/2 | ceiling, K | lowest mean future | scorer |",
          "|---|---|---|---|---|---|---|---|"]
    for kind, per_budget in pred["summary"].items():
        for b, s in per_budget.items():
            cells = [with_ci(s.get(k), s.get(f"{k}_ci"), 3)
                     for k in ("agreement", "ceiling_half", "ceiling", "mean_future", "scorer")]
            md.append(f"| {pred.get('states', {}).get(kind, kind)} | {b} | {s['traces']} | " + " | ".join(cells) + " |")
    return md


def machine() -> str:
    """The machine a report was measured on: processor, cores, operating system."""
    cpu = platform.processor() or platform.machine()
    try:
        name = next(x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith("model name"))
    except (OSError, StopIteration):
        name = cpu
    return f"{name}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def merged_ablations(out: Path) -> list[dict] | None:
    """The rows of every ablation evaluation (``eval-ablations-*``), the main SFT scorer and golden once."""
    rows, seen = [], set()
    for d in sorted(Path(out).glob("eval-ablations-*")):
        for r in _load(d / "results.json") or []:
            if r["method"] not in seen:
                seen.add(r["method"])
                rows.append(r)
    return rows or None


def write_report(out: Path, report: Path, sft_ablations, samplers, command: str, took: dict,
                 main_sampler: tuple[str, int] | None = None) -> dict:
    """``report/results.md`` and ``report/results.json`` from the benchmark folder ``out``; figures copied or drawn
    into ``report``. Returns the results dict."""
    out, report = Path(out), Path(report)
    report.mkdir(parents=True, exist_ok=True)
    rows, meta = _load(out / "eval" / "results.json"), _load(out / "eval" / "meta.json")
    if not rows or not meta:
        raise FileNotFoundError(f"{out / 'eval'} has no finished evaluation (run the eval stage first)")
    traces_meta = _load(out / "traces" / "meta.json") or {}
    trained_on = (f"{traces_meta.get('num_traces', '?')} kept (tokens: {json.dumps(traces_meta.get('length'))}) from "
                  "the training prompts of `data_prep/prompts/realbench.jsonl`" if traces_meta else
                  "none in this folder (an evaluation of given scorers: their checkpoints' `config.json` say what they "
                  "were trained on)")
    sft, grpo = _load(out / "sft" / "metrics.json"), _load(out / "grpo" / "metrics.json")
    predictability = _load(out / "predictability" / "summary.json")
    checks, rl = goal_checks(rows), grpo_vs_sft(rows)
    ablation_rows = merged_ablations(out)
    labels = {"foresight-sft": main_label(_load(out / "sft" / "config.json"))} | {
        f"foresight-sft({name})": f"{name}: {what}" for name, what, _ in sft_ablations}
    sampler_rows = {m: _load(out / f"eval-sampler-{m}" / "results.json") for m in samplers}
    if main_sampler is not None and sampler_rows.get(main_sampler[0]) is None:  # the main evaluation's own sampler
        sampler_rows[main_sampler[0]] = [r for r in rows if r["budget"] == main_sampler[1]] or None
    for f in FIGURES:
        if (out / "eval" / f).exists():
            shutil.copyfile(out / "eval" / f, report / f)
    has_grpo_fig = grpo_figure(grpo, report / "grpo.png")

    md = [f"# Real-model benchmark: {meta.get('model')}\n",
          f"- **Command:** `{command}` (`make realbench`)",
          f"- **Commit:** {git_commit() or 'unknown'}; written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          f"- **Machine:** {machine()}",
          f"- **Stage seconds (all runs of this folder):** {json.dumps(took)}",
          f"- **Training traces:** {trained_on}; **held-out:** "
          f"{meta['num_problems']} references, mean {meta['mean_trace_length']:.0f} tokens (prompt "
          f"{meta['mean_prompt_length']:.0f}), sampled with the recipe's settings and a fixed seed.",
          "- **Metrics:** loss ratio = Σ evicted loss / Σ full-cache loss over generated tokens; Δloss = mean loss "
          "increase per token after the first eviction, on the 80% lowest-entropy tokens (low-H) and the rest "
          "(high-H); recall@L = overlap of a method's L choices with golden's along golden's trajectory; keep recall "
          "= at the same steps, the share of the candidates golden keeps that the method keeps too (KVpop's top-k "
          "retention recall). All intervals: 95% bootstrap over held-out traces.\n",
          "## All methods\n", results_table(rows, meta),
          "\n## Goal checks\n",
          "| B:L | best learned | loss ratio | best heuristic | its loss ratio | below every heuristic | intervals "
          "separated from every heuristic | not separated from | separated from every heuristic holding no more memory "
          "(holding more) | paired: not below (95% CI of the difference on the same traces) | ≤ best heuristic at 2B | "
          "recall@L [95% CI] | keep recall [95% CI] |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        md.append(f"| {c['budget']}:{c['interval']} | {c['best_learned']} | {c['loss_ratio']:.4f} | {c['best_heuristic']} | "
                  f"{c['best_heuristic_loss_ratio']:.4f} | {_yes(c['below_every_heuristic'])} | "
                  f"{_yes(c['separated_from_every_heuristic'])} | {', '.join(c['heuristics_not_separated']) or '—'} | "
                  f"{_yes(c['separated_at_equal_memory'])} ({', '.join(c['heuristics_holding_more']) or '—'}) | "
                  f"{', '.join(c.get('heuristics_not_below_paired', [])) or 'none'} | "
                  f"{_yes(c['at_or_below_best_heuristic_at_2B'])} ({c['best_heuristic_at_2B'] or '—'}) | "
                  f"{with_ci(c['recall_at_L'], c['recall_at_L_ci'], 3)} | "
                  f"{with_ci(c.get('keep_recall'), c.get('keep_recall_ci'), 3)} |")
    md += predictability_section(predictability)
    md += ["\n**GRPO against SFT** (Δloss on low-entropy tokens):\n", "| B | SFT [95% CI] | GRPO [95% CI] | GRPO below, "
           "intervals separated |", "|---|---|---|---|"]
    md += [f"| {g['budget']} | {with_ci(g['sft'], g['sft_ci'], cell=dloss)} | {with_ci(g['grpo'], g['grpo_ci'], cell=dloss)} | "
           f"{_yes(g['grpo_below_with_separated_intervals'])} |" for g in rl]
    md += ["\n## Ablations (middle budget)\n"]
    md += [ablation_table(ablation_rows, labels) if ablation_rows else "Not run.\n"]
    md += ["\n**Eviction sampler at evaluation** (the paper's Table 5: top-L, Top-2L multinomial, multinomial over all "
           "candidates):\n"]
    md += sampler_table(sampler_rows, main_sampler[0] if main_sampler else None)
    md += ["\n## Training\n",
           f"SFT: {json.dumps({k: v for k, v in (sft or {}).items() if k != 'history'})}\n",
           "GRPO per step:\n", grpo_section(grpo)]
    if has_grpo_fig:
        md.append("![GRPO](grpo.png)\n")
    md += [f"![{f}]({f})\n" for f in FIGURES if (report / f).exists()]
    atomic.write_text(report / "results.md", "\n".join(md) + "\n")
    results = {"command": command, "commit": git_commit(), "stage_seconds": took, "meta": meta,
               "traces": {k: traces_meta.get(k) for k in ("num_traces", "length")},
               "main": _compact(rows), "goal_checks": checks, "grpo_vs_sft": rl, "ablations": _compact(ablation_rows),
               "samplers": {m: _compact(r) for m, r in sampler_rows.items()}, "sft": sft, "grpo": grpo,
               "predictability": predictability}
    atomic.write_json(report / "results.json", results, indent=1)
    print(f"report: {report / 'results.md'}", flush=True)
    return results
