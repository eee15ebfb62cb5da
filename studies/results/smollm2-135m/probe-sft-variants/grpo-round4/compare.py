"""GRPO runs against their start, the width-64 SFT scorer, on the probe's 48 held-out references: loss ratio, low-/
high-entropy loss increase and recall@L with their 95% intervals, and the paired interval of the loss-ratio change.
Usage: python compare.py runs/probe/eval-dagger/results.json (or eval-results.json here)"""
import json
import sys

from foresight.evaluation.report import paired_ratio_diff_ci

LABELS = {"foresight-grpo": "round 3: set ratio, lr 1e-3, 6 x 2 traces (grpo-p2)",
          "foresight-grpo(grpo-d4)": "draw ratio, lr 3e-4, 6 x 4 traces (grpo-d4)",
          "foresight-grpo(grpo-d4e)": "draw ratio, lr 3e-4, eta 0.5, 6 x 4 traces (grpo-d4e)"}
rows = {(r["method"], r["budget"]): r for r in json.load(open(sys.argv[1]))}


def cell(r, k):
    lo, hi = r[f"{k}_ci"]
    return f"{r[k]:.4f} [{lo:.4f}, {hi:.4f}]"


for b in (128, 256):
    start = rows[("foresight-sft", b)]
    print(f"B={b}")
    print("| scorer | loss ratio [95% CI] | change vs start, paired [95% CI] | Δ low-H loss [95% CI] | "
          "Δ high-H loss [95% CI] | recall@L |")
    print("|---|---|---|---|---|---|")
    print(f"| SFT width 64 (start) | {cell(start, 'loss_ratio')} | — | {cell(start, 'low_entropy_loss_increase')} | "
          f"{cell(start, 'high_entropy_loss_increase')} | {start['recall_at_L']:.3f} |")
    for method, label in LABELS.items():
        r = rows.get((method, b))
        if r is None:
            continue
        lo, hi = paired_ratio_diff_ci(r["per_trace"], start["per_trace"])
        print(f"| {label} | {cell(r, 'loss_ratio')} | {r['loss_ratio'] - start['loss_ratio']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
              f"{cell(r, 'low_entropy_loss_increase')} | {cell(r, 'high_entropy_loss_increase')} | {r['recall_at_L']:.3f} |")
    print()
