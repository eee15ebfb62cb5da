"""SFT on three budgets (sft.budgets=128:32,256:32,512:32) and its control (B=256 only with as many stored steps per
trace, 12) against the width-64 probe scorer (B=256, 4 steps per trace), on the 48 held-out references: each budget's
loss ratio, Δ low-entropy loss, recall@L and keep recall, and the paired 95% interval of the loss-ratio difference to
the width-64 scorer (python compare.py PATH/TO/eval-budgets/results.json)."""
import json
import sys

from foresight.evaluation.report import paired_ratio_diff_ci

rows = {(r["method"], r["budget"]): r for r in json.load(open(sys.argv[1]))}
SCORERS = {"foresight-sft": "B=256, 4 steps per trace (width-64 probe scorer)",
           "foresight-sft(v-steps12)": "B=256, 12 steps per trace (control)",
           "foresight-sft(v-budgets)": "B=128, 256 and 512, 4 steps each"}
print("| B:L | trained on | loss ratio [95% CI] | Δloss low-H [95% CI] | recall@L | keep recall | − width-64 scorer (paired) |")
print("|---|---|---|---|---|---|---|")
for b in sorted({k[1] for k in rows}):
    base = rows.get(("foresight-sft", b))
    if base is None:
        continue
    for m, label in SCORERS.items():
        r = rows.get((m, b))
        if r is None:
            continue
        d = "—" if r is base else "{:+.4f} {}".format(r["loss_ratio"] - base["loss_ratio"],
                                                     paired_ratio_diff_ci(r["per_trace"], base["per_trace"]))
        lo, hi = r["loss_ratio_ci"]
        llo, lhi = r["low_entropy_loss_increase_ci"]
        print(f"| {b}:{r['interval']} | {label} | {r['loss_ratio']:.4f} [{lo:.4f}, {hi:.4f}] | "
              f"{r['low_entropy_loss_increase']:.4f} [{llo:.4f}, {lhi:.4f}] | {r['recall_at_L']:.3f} | "
              f"{r['keep_recall']:.3f} | {d} |")
