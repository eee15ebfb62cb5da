"""Mean of two SFT seeds of `ahead` minus the mean of two recipe seeds: loss ratio per bootstrap resample of the
validation traces (the same resample for all four runs), 95% percentile interval
(docs/results/smollm2-135m/probe-sft-variants/ahead/).

    python studies/results/smollm2-135m/probe-sft-variants/ahead/seed_mean.py runs/s34/val-base runs/s34/val-base-s1 \
        runs/s35/val-ahead runs/s35/val-ahead-s1
"""
import json
import sys

import numpy as np

from foresight.evaluation.paired import resamples


def rows(path):
    r = json.load(open(f"{path}/results.json"))
    r = r["rows"] if isinstance(r, dict) else r
    out = {}
    for x in r:
        if x["method"] == "foresight-sft":
            p = x["per_trace"]
            order = np.argsort(p["trace"])
            out[x["budget"]] = (np.array(p["evicted_loss"])[order], np.array(p["full_loss"])[order])
    return out


base_a, base_b, cand_a, cand_b = (rows(p) for p in sys.argv[1:5])
for B in sorted(base_a):
    n = len(base_a[B][0])
    idx = resamples(n, 0)
    ratio = lambda r, i: r[0][i].sum(-1) / r[1][i].sum(-1)  # noqa: E731
    diff = (ratio(cand_a[B], idx) + ratio(cand_b[B], idx)) / 2 - (ratio(base_a[B], idx) + ratio(base_b[B], idx)) / 2
    point = (ratio(cand_a[B], slice(None)) + ratio(cand_b[B], slice(None))) / 2 - \
        (ratio(base_a[B], slice(None)) + ratio(base_b[B], slice(None))) / 2
    lo, hi = np.percentile(diff, [2.5, 97.5])
    print(f"B={B}: seed-mean difference {point:+.4f} [{lo:+.4f}, {hi:+.4f}] over {n} traces")
