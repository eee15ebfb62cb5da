"""The probe's second round on the 48 held-out references: each width-64 variant against the width-64 start (paired
95% intervals of the loss-ratio difference) and against the heuristics' rows of ../results.json (same references)."""
import json
import sys
from pathlib import Path

from foresight.evaluation.report import paired_ratio_diff_ci
DATA = Path(__file__).resolve().parents[5] / "docs/results/smollm2-135m/probe-sft-variants/dagger"  # the default folder
here = sys.argv[1] if len(sys.argv) > 1 else DATA
new = {(r["method"], r["budget"]): r for r in json.load(open(f"{here}/results.json"))}
old = {(r["method"], r["budget"]): r for r in json.load(open(f"{here}/../results.json"))}
names = {"foresight-sft": "width 64 (start)", "foresight-sft(v-cont)": "+200 steps, golden states",
         "foresight-sft(v-dagger1)": "+200 steps, golden + own states", "foresight-sft(v-poolmax)": "golden max pooling",
         "foresight-sft(v-attnonly)": "inputs: attention statistics only", "foresight-sft(v-kvonly)": "inputs: key + value only"}
for b in (128, 256):
    start = new[("foresight-sft", b)]
    same = start['per_trace'] == old[('foresight-sft(v-width64)', b)]['per_trace']
    print(f"B={b}: start row equal to the earlier evaluation's: {same}")
    print("| scorer | loss ratio [95% CI] | Δ low-H loss | recall@L | keep recall | − start (paired) | − Scissorhands (paired) |")
    print("|---|---|---|---|---|---|---|")
    for m, label in names.items():
        if (m, b) not in new:
            continue
        r = new[(m, b)]
        lo, hi = r["loss_ratio_ci"]
        d0 = "—" if m == "foresight-sft" else "{:+.4f} {}".format(
            r["loss_ratio"] - start["loss_ratio"], paired_ratio_diff_ci(r["per_trace"], start["per_trace"]))
        sc = old[("scissorhands", b)]
        d1 = "{:+.4f} {}".format(r["loss_ratio"] - sc["loss_ratio"], paired_ratio_diff_ci(r["per_trace"], sc["per_trace"]))
        print(f"| {label} | {r['loss_ratio']:.4f} [{lo:.4f}, {hi:.4f}] | {r['low_entropy_loss_increase']:.4f} | "
              f"{r['recall_at_L']:.3f} | {r['keep_recall']:.3f} | {d0} | {d1} |")
    for m in ("scissorhands", "snapkv", "tova", "streamingllm", "golden"):
        r = old[(m, b)]
        lo, hi = r["loss_ratio_ci"]
        print(f"| {m} | {r['loss_ratio']:.4f} [{lo:.4f}, {hi:.4f}] | {r['low_entropy_loss_increase']:.4f} | "
              f"{r.get('recall_at_L') or '—'} | {r.get('keep_recall') or '—'} | | |")
    print()
