"""DAgger probe: loss ratios [95% CI] and paired differences on the 48 held-out references (old rows: runs/probe/eval)."""
import json
from foresight.report import paired_ratio_diff_ci
old = {(r["method"], r["budget"]): r for r in json.load(open("runs/probe/eval/results.json"))}
new = {(r["method"], r["budget"]): r for r in json.load(open("runs/probe/eval-dagger/results.json"))}
out = {}
for b in (128, 256):
    w_old, w_new = old[("foresight-sft(v-width64)", b)], new[("foresight-sft", b)]
    print(f"B={b}: width64 row reproduced bit for bit across the engine change:", w_old["per_trace"] == w_new["per_trace"], w_old["loss_ratio"], w_new["loss_ratio"])
    rows = {m: r for (m, bb), r in new.items() if bb == b and m != "full"}
    rows.update({m: r for (m, bb), r in old.items() if bb == b and m in ("golden", "scissorhands", "snapkv", "tova", "streamingllm")})
    for m, r in rows.items():
        print(f"  {m:28s} ratio {r['loss_ratio']:.4f} {r['loss_ratio_ci'][1] if isinstance(r['loss_ratio_ci'], (list, tuple)) else r['loss_ratio_ci']}"
              f" low-ent {r['low_entropy_loss_increase']:.4f} recall {r.get('recall_at_L')} keep {r.get('keep_recall')}")
    for a in ("foresight-sft(v-dagger1)", "foresight-sft(v-cont)"):
        for ref in ("foresight-sft", "foresight-sft(v-cont)", "scissorhands", "snapkv"):
            if a != ref:
                d = rows[a]["loss_ratio"] - rows[ref]["loss_ratio"]
                print(f"    {a} - {ref}: {d:+.4f} {paired_ratio_diff_ci(rows[a]['per_trace'], rows[ref]['per_trace'])}")
