"""Rank correlation and recall@32 of each statistic against golden's future score on the screen's rows, and a
per-(layer, KV head) ridge regression of log future on the log statistics, fitted on 16 traces and scored on the
other 16 (docs/results/smollm2-135m/probe-sft-variants/ahead/)."""
import torch
rows = torch.load("runs/s35/screen.pt")
def rc(a, b):
    ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm() + 1e-9))
def recall(score, fut, L=32):
    a = set(score.argsort()[:L].tolist())
    b = set(fut.argsort()[:L].tolist())
    return len(a & b) / L
names = [n for n in rows[0] if n not in ("future", "layer", "t", "trace")]
for n in names:
    print(f"{n:10s} rankcorr {sum(rc(r[n], r['future']) for r in rows)/len(rows):.4f}  "
          f"recall@32 {sum(recall(r[n], r['future']) for r in rows)/len(rows):.4f}")
# ridge per layer from log features -> log future; train on first half of traces, test on second
eps = 1e-6
def X(r, feats):
    cols = [torch.log(r[n] + eps) if n != "age" else r[n] for n in feats]
    return torch.stack(cols + [torch.ones_like(cols[0])], 1)
traces = sorted({r["trace"] for r in rows})
tr = set(traces[:16])
base = ["sum", "max", "w8", "cum", "age"]
for feats in (base, base + ["shift32"], base + ["shift16", "shift32", "shift64", "shift128"], ["shift32"]):
    res = []
    for layer in range(30):
        for h in range(3):
            R = [r for r in rows if r["layer"] == layer and r["trace"] in tr]
            Xa = torch.cat([X(r, feats) for r in R])
            ya = torch.cat([torch.log(r["future"] + eps) for r in R])
            w = torch.linalg.solve(Xa.T @ Xa + 1e-3 * torch.eye(Xa.shape[1]), Xa.T @ ya)
            for r in rows:
                if r["layer"] == layer and r["trace"] not in tr:
                    s = X(r, feats) @ w
                    res.append((rc(s, r["future"]), recall(s, r["future"])))
    print(f"ridge {'+'.join(feats)}: rankcorr {sum(a for a,_ in res)/len(res):.4f} "
          f"recall@32 {sum(b for _,b in res)/len(res):.4f}")
