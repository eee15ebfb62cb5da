"""Rank correlation of golden's future score with a pair's own block statistics and with the layer's head average
(foresight.engine.features.head_mean) over the candidates of stored golden states
(docs/results/smollm2-135m/probe-sft-variants/heads/).

    FORESIGHT_CACHE=runs/s34/cache python studies/results/smollm2-135m/probe-sft-variants/heads/correlation.py
"""

import glob
import os

import torch

from foresight.engine.features import STAT_NAMES, head_mean

HEAD_DIM, GROUP = 64, 3  # SmolLM2-135M
files = sorted(glob.glob(os.path.join(os.environ.get("FORESIGHT_CACHE", "runs/s34/cache"), "golden/*/trace-*.pt")))


def rankcorr(a, b):
    ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm() + 1e-9))


def rows(trace_files):
    """(own statistics, head average, future score) of each (step, every third layer, head) with >= 20 candidates."""
    for f in trace_files:
        d = torch.load(f)
        x = d["x"].float()  # [steps, layers, 1, heads, slots, D]
        own = x[..., 2 * HEAD_DIM:2 * HEAD_DIM + 8 * GROUP].unflatten(-1, (8, GROUP)).mean(-1)  # [..., slots, 8]
        avg = head_mean(own, d["age"])
        for s in range(x.shape[0]):
            for layer in range(0, x.shape[1], 3):
                for h in range(x.shape[3]):
                    c = d["cand"][s, layer, 0, h]
                    if c.sum() >= 20:
                        yield own[s, layer, 0, h][c], avg[s, layer, 0, h][c], d["future"][s, layer, 0, h][c]


k = STAT_NAMES.index("sum")
got = [(rankcorr(o[:, k], f), rankcorr(a[:, k], f)) for o, a, f in rows(files[:24])]
print(f"{len(got)} rows: own sum {sum(g[0] for g in got) / len(got):.4f}, head-averaged sum "
      f"{sum(g[1] for g in got) / len(got):.4f}")
for name in ("sum", "max", "cum", "decay"):
    k = STAT_NAMES.index(name)
    for w in (0.0, 0.25, 0.5):
        v = [rankcorr((1 - w) * o[:, k] + w * a[:, k], f) for o, a, f in rows(files[:12])]
        print(f"{name} with {w} of the head average: {sum(v) / len(v):.4f}")
