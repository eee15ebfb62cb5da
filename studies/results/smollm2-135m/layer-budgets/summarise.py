"""Paired comparisons of the evaluations in docs/results/smollm2-135m/layer-budgets/ on the same 48 held-out
references: uniform budgets (``uniform/``), layers 15–24 at twice the others' share (``layers/``, mean budget B), layer
18's KV head 2 whole at B' (``whole/``) and both (``layers-whole/``); the scorer with the prompt protected on top of B,
as random-keep-prompt keeps it (``prompt/``, ``prompt-layers/``); all three together and the Top-2L sampler
on the 48 references (``prompt-layers-whole/``, ``layers-whole-sample/``, ``prompt-layers-whole-sample/``) and the
headline's comparison at B'=242 on 192 references (``r192/``).

    python studies/results/smollm2-135m/layer-budgets/summarise.py
"""

import json
from pathlib import Path

from foresight.evaluation.report import paired_ratio_diff_ci

HERE = Path(__file__).resolve().parents[4] / "docs/results/smollm2-135m/layer-budgets"  # the data
runs = {name: json.loads((HERE / name / "results.json").read_text())
        for name in ("uniform", "layers", "whole", "layers-whole", "prompt", "prompt-layers")}
MATCH = {114: 128, 242: 256}  # B' with the whole head: the memory of the uniform B at the end of the longest reference
SCORER = "foresight-sft"


def row(run, method, budget):
    return next((r for r in runs[run] if r["method"] == method and r["budget"] == budget), None)


def diff(a, b):
    """loss ratio of b − a on the same traces, with its paired 95% interval."""
    return f"{b['loss_ratio'] - a['loss_ratio']:+.4f} {paired_ratio_diff_ci(b['per_trace'], a['per_trace'])}"


def cell(r):
    return f"{r['loss_ratio']:.4f} {r['loss_ratio_ci']} · {r['mean_cache']}"


print("| method | B | uniform: loss ratio [95% CI] · mean cache | layers 15–24 ×2 | layers − uniform, paired |")
print("|---|---|---|---|---|")
for B in (128, 256):
    for r in sorted((r for r in runs["layers"] if r["budget"] == B and r["method"] != "full"), key=lambda r: r["loss_ratio"]):
        u = row("uniform", r["method"], B)
        print(f"| {r['method']} | {B} | {cell(u)} | {cell(r)} | {diff(u, r)} |")
print()
print("| method | B' (uniform B) | whole 18:2 | layers ×2 + whole 18:2 | − uniform B, paired | − whole alone, paired |")
print("|---|---|---|---|---|---|")
for B, U in MATCH.items():
    for r in sorted((r for r in runs["layers-whole"] if r["budget"] == B and r["method"] != "full"),
                    key=lambda r: r["loss_ratio"]):
        w, u = row("whole", r["method"], B), row("uniform", r["method"], U)
        print(f"| {r['method']} | {B} ({U}) | {cell(w) if w else '—'} | {cell(r)} | {diff(u, r)} | "
              f"{diff(w, r) if w else '—'} |")
print()
print("| allocation | B | the scorer − method (both with the allocation), paired |")
print("|---|---|---|")
for run, budgets in (("layers", (128, 256)), ("layers-whole", tuple(MATCH))):
    for B in budgets:
        s = row(run, SCORER, B)
        for r in sorted((r for r in runs[run] if r["budget"] == B and r["method"] not in ("full", SCORER)),
                        key=lambda r: r["loss_ratio"]):
            print(f"| {run} | {B} | − {r['method']}: {diff(r, s)} |")
print()
for run, pairs in (("uniform", ((128, 256), (256, 512))), ("layers", ((128, 256), (256, 512))),
                   ("whole", ((114, 256), (242, 512))), ("layers-whole", ((114, 256), (242, 512))),
                   ("prompt", ((128, 256), (256, 512))), ("prompt-layers", ((128, 256), (256, 512)))):
    for B, B2 in pairs:
        s = row(run, SCORER, B)
        best = min((r for r in runs["uniform"] if r["budget"] == B2 and r["method"] not in ("full", SCORER)),
                   key=lambda r: r["loss_ratio"])
        print(f"2B headline, {run} at B={B}: scorer {s['loss_ratio']:.4f} (mean cache {s['mean_cache']}) against the "
              f"best heuristic at uniform {B2}, {best['method']} {best['loss_ratio']:.4f}: {diff(best, s)}")
print()
print("| scorer, prompt protected (at 128 only where it fits: the others evict it) | B | loss ratio · mean cache | "
      "− the same allocation without, paired |")
print("|---|---|---|---|")
for run, base in (("prompt", "uniform"), ("prompt-layers", "layers")):
    for B in (128, 256):
        s, u = row(run, SCORER, B), row(base, SCORER, B)
        print(f"| {run} | {B} | {cell(s)} | {diff(u, s)} |")
print()
VAL = HERE / "val256"  # the layer shares at B=256 on the search's 32 validation traces
if VAL.exists():
    def scorer_row(name):
        return next(r for r in json.loads((VAL / name / "results.json").read_text()) if r["method"] == SCORER)

    base = scorer_row("uniform")
    print(f"| validation traces, B=256 | loss ratio · mean cache | − uniform 256 ({base['loss_ratio']:.4f}), paired |")
    print("|---|---|---|")
    for name in ("layers-2", "layers-whole"):
        if not (VAL / name).exists():
            continue
        r = scorer_row(name)
        print(f"| {name} (B={r['budget']}) | {cell(r)} | {diff(base, r)} |")
print()
S40 = ("prompt-layers-whole", "layers-whole-sample", "prompt-layers-whole-sample")  # all three together, the 48 references
print("| scorer at B' (allocation: layers ×2 + head 18:2 whole) | B' | loss ratio · mean cache | − layers-whole, paired | "
      "− best heuristic at uniform 2B (random-keep-prompt), paired |")
print("|---|---|---|---|---|")
for name in S40:
    for r in json.loads((HERE / name / "results.json").read_text()):
        if r["method"] != SCORER:
            continue
        B = r["budget"]
        base, rkp = row("layers-whole", SCORER, B), row("uniform", "random-keep-prompt", 2 * MATCH[B])
        print(f"| {name} | {B} | {cell(r)} | {diff(base, r)} | {diff(rkp, r)} |")
R192 = HERE / "r192"  # the headline at B'=242 on 192 held-out references
if R192.exists():
    def rows192(name):
        return json.loads((R192 / name / "results.json").read_text())

    s = next(r for r in rows192("prompt-layers-whole") if r["method"] == SCORER)
    print()
    print(f"192 references: the scorer at B'={s['budget']}, prompt on top, layers ×2 + head 18:2 whole: {cell(s)}")
    for name in ("uniform", "layers-whole-rkp"):
        if (R192 / name).exists():
            for r in rows192(name):
                if r["method"] == "random-keep-prompt":
                    print(f"  − random-keep-prompt at {r['budget']} ({name}: {cell(r)}): {diff(r, s)}")
