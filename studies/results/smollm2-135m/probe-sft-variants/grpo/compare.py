"""GRPO (grpo-p2) against its start, the width-64 SFT scorer, on the probe's 48 held-out references: loss ratio and
low-/high-entropy loss increase with their 95% intervals, and the paired interval of the loss-ratio difference.
Usage: python compare.py eval-results.json (or runs/probe/eval-dagger/results.json)"""
import json
import sys

from foresight.evaluation.report import paired_ratio_diff_ci

rows = {(r["method"], r["budget"]): r for r in json.load(open(sys.argv[1]))}
grpo_name = next(m for m, _ in rows if "grpo" in m)
for b in (128, 256):
    start, grpo = rows[("foresight-sft", b)], rows[(grpo_name, b)]
    print(f"B={b}")
    print("| scorer | loss ratio [95% CI] | Δ low-H loss [95% CI] | Δ high-H loss [95% CI] | recall@L | keep recall |")
    print("|---|---|---|---|---|---|")
    for label, r in (("SFT width 64 (start)", start), ("+ GRPO, 6 steps x 2 traces", grpo)):
        ci = {k: r[f"{k}_ci"] for k in ("loss_ratio", "low_entropy_loss_increase", "high_entropy_loss_increase")}
        print(f"| {label} | {r['loss_ratio']:.4f} [{ci['loss_ratio'][0]:.4f}, {ci['loss_ratio'][1]:.4f}] | "
              f"{r['low_entropy_loss_increase']:.4f} "
              f"[{ci['low_entropy_loss_increase'][0]:.4f}, {ci['low_entropy_loss_increase'][1]:.4f}] | "
              f"{r['high_entropy_loss_increase']:.4f} "
              f"[{ci['high_entropy_loss_increase'][0]:.4f}, {ci['high_entropy_loss_increase'][1]:.4f}] | "
              f"{r['recall_at_L']:.3f} | {r['keep_recall']:.3f} |")
    d = paired_ratio_diff_ci(grpo["per_trace"], start["per_trace"])
    print(f"GRPO − start, paired: {grpo['loss_ratio'] - start['loss_ratio']:+.4f} {d}\n")
