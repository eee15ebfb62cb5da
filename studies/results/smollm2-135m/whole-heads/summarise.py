"""Paired comparisons of the whole-head evaluation (docs/results/smollm2-135m/whole-heads/results.json) against the
uniform-budget one on the same 48 held-out references (docs/results/smollm2-135m/all-methods/results.json): each method
at B' with layer 18's KV head 2 whole against itself at the uniform B it matches in memory, and the recommended scorer
against every heuristic at the same B'.

    python studies/results/smollm2-135m/whole-heads/summarise.py
"""

import json
from pathlib import Path

from foresight.evaluation.report import paired_ratio_diff_ci

HERE = Path(__file__).resolve().parents[4] / "docs/results/smollm2-135m/whole-heads"  # the data
whole = json.loads((HERE / "results.json").read_text())
uniform = json.loads((HERE.parent / "all-methods" / "results.json").read_text())
MATCH = {114: 128, 242: 256}


def row(rows, method, budget):
    return next((r for r in rows if r["method"] == method and r["budget"] == budget), None)


def diff(a, b):
    """loss ratio of b − a on the same traces, with its paired 95% interval."""
    return round(b["loss_ratio"] - a["loss_ratio"], 4), paired_ratio_diff_ci(b["per_trace"], a["per_trace"])


print("| B' (whole 18:2) | method | loss ratio [95% CI] | mean cache | uniform B | its loss ratio | mean cache | "
      "whole − uniform, paired |")
print("|---|---|---|---|---|---|---|---|")
for B, U in MATCH.items():
    for r in sorted((r for r in whole if r["budget"] == B and r["method"] != "full"), key=lambda r: r["loss_ratio"]):
        u = row(uniform, r["method"], U)
        d = diff(u, r) if u else (None, None)
        print(f"| {B} | {r['method']} | {r['loss_ratio']:.4f} {r['loss_ratio_ci']} | {r['mean_cache']} | {U} | "
              f"{u['loss_ratio'] if u else '—'} | {u['mean_cache'] if u else '—'} | {d[0]} {d[1]} |")
print()
print("| B' | recommended scorer − method, both with the whole head, paired |")
print("|---|---|")
for B in MATCH:
    s = row(whole, "foresight-sft", B)
    for r in sorted((r for r in whole if r["budget"] == B and r["method"] not in ("full", "foresight-sft", "golden")),
                    key=lambda r: r["loss_ratio"]):
        d = diff(r, s)
        print(f"| {B} | − {r['method']}: {d[0]} {d[1]} |")
print()
best2b = {B: min((r for r in uniform if r["budget"] == 2 * U and r["method"] not in ("full", "golden", "foresight-sft")),
                 key=lambda r: r["loss_ratio"]) for B, U in MATCH.items()}
for B, r in best2b.items():
    s = row(whole, "foresight-sft", B)
    print(f"2B headline at B'={B}: scorer {s['loss_ratio']} against the best heuristic at uniform 2B={r['budget']} "
          f"({r['method']}) {r['loss_ratio']}; paired {diff(r, s)}")
