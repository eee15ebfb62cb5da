"""The tables of docs/results/smollm2-135m/all-methods/README.md from its results.json: every method at each budget
with its interval, and the learned scorer minus each method, paired over the same held-out traces
(foresight.evaluation.report.paired_ratio_diff_ci)."""

import json
import sys
from pathlib import Path

from studies.realbench.goals import goal_checks
from foresight.evaluation.report import paired_ratio_diff_ci

# the data: docs/results/smollm2-135m/all-methods/ (the repository root is four folders above this file)
here = Path(__file__).resolve().parents[4] / "docs/results/smollm2-135m/all-methods"
rows = json.loads((Path(sys.argv[1]) if len(sys.argv) > 1 else here / "results.json").read_text())
LEARNED = "foresight-sft"


def ci(r, key, nd):
    v, c = r.get(key), r.get(f"{key}_ci")
    if v is None:
        return "—"
    return f"{v:.{nd}f}" + (f" [{c[0]:.{nd}f}, {c[1]:.{nd}f}]" if c else "")


print("| B:L | method | prompt kept | loss ratio [95% CI] | Δloss low-H | Δloss high-H | recall@L | keep recall | mean cache |"
      f" {LEARNED} − method, paired [95% CI] |")
print("|---|---|---|---|---|---|---|---|---|---|")
for B in sorted({r["budget"] for r in rows}):
    at = [r for r in rows if r["budget"] == B]
    learned = next((r for r in at if r["method"] == LEARNED), None)
    for r in sorted(at, key=lambda r: r["loss_ratio"]):
        d = "—"
        if learned is not None and r is not learned and r["method"] != "full" and r.get("per_trace"):
            c = paired_ratio_diff_ci(learned["per_trace"], r["per_trace"])
            d = f"{learned['loss_ratio'] - r['loss_ratio']:+.4f} [{c[0]:+.4f}, {c[1]:+.4f}]"
        name = f"**{r['method']}**" if r is learned else r["method"]
        print(f"| {B}:{r['interval']} | {name} | {'yes' if r.get('protect_prompt') else 'no'} | {ci(r, 'loss_ratio', 4)} |"
              f" {ci(r, 'low_entropy_loss_increase', 3)} | {ci(r, 'high_entropy_loss_increase', 3)} |"
              f" {ci(r, 'recall_at_L', 3)} | {ci(r, 'keep_recall', 3)} | {r.get('mean_cache', 0):.1f} | {d} |")
print()
print("| B | best learned | its loss ratio | best heuristic | its loss ratio | below every heuristic, paired |"
      " best heuristic at 2B | learned ≤ it |")
print("|---|---|---|---|---|---|---|---|")
for g in goal_checks(rows):
    twice = next((r for r in rows if r["budget"] == 2 * g["budget"] and r["method"] == g["best_heuristic_at_2B"]), None)
    twice_ratio = "" if twice is None else f" {twice['loss_ratio']:.4f}"
    at_2b = g["at_or_below_best_heuristic_at_2B"]
    paired = "yes" if not g["heuristics_not_below_paired"] else "no: " + ", ".join(g["heuristics_not_below_paired"])
    print(f"| {g['budget']} | {g['best_learned']} | {g['loss_ratio']:.4f} | {g['best_heuristic']} |"
          f" {g['best_heuristic_loss_ratio']:.4f} | {paired} | {g['best_heuristic_at_2B'] or '—'}{twice_ratio} |"
          f" {'—' if at_2b is None else ('yes' if at_2b else 'no')} |")
