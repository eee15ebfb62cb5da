"""How far GRPO moved the scorer, on golden's states of the 8 traces no stage trained on (the probe's last 8, GRPO's
validation traces): recall@L against golden of the start and of the GRPO scorer, and the overlap of their own top-L
sets on the same states (1.0: GRPO changed no decision). Usage: python agreement.py START GRPO (scorer folders)."""
import sys

import torch

from foresight.scorers.checkpoint import load_scorer
from foresight.config.recipe import load_recipe
from foresight.training.golden_store import GoldenStore
from foresight.engine.models import load_model
from foresight.evaluation.report import bootstrap_ci
from foresight.training.sft import recall_at_l
from foresight.data.trace_data import load_traces

r = load_recipe("recipes/smollm2-135m-realbench.yaml", ["traces.num_prompts=64"])
model, _ = load_model(r.model)
ds = load_traces("runs/probe/traces")
held = list(range(len(ds) - 8, len(ds)))
start, _ = load_scorer(sys.argv[1], model)
grpo, _ = load_scorer(sys.argv[2], model)
gold = GoldenStore(model, r.cache, "mean", r.sft.example_steps, r.sft.seed)
L = r.cache.interval
rows = {"recall@L start": [], "recall@L grpo": [], "top-L overlap start/grpo": []}
with torch.no_grad():
    for i in held:
        per = {k: [] for k in rows}
        for x, fut, cand in gold.examples(ds[i], start):
            n = x.shape[3]
            a, b = start(x).reshape(-1, n), grpo(x).reshape(-1, n)
            f, c = fut.reshape(-1, n), cand.reshape(-1, n)
            per["recall@L start"].append(recall_at_l(a, f, c, L).mean().item())
            per["recall@L grpo"].append(recall_at_l(b, f, c, L).mean().item())
            # golden evicts the lowest "future": with -a as the future, golden's set is the start scorer's own top-L
            per["top-L overlap start/grpo"].append(recall_at_l(b, -a, c, L).mean().item())
        for k in rows:
            rows[k].append(sum(per[k]) / len(per[k]))
for k, v in rows.items():
    lo, hi = bootstrap_ci(v)
    print(f"{k:26s} {sum(v) / len(v):.4f} [{lo:.4f}, {hi:.4f}]  (8 traces x {r.sft.example_steps} golden states)")
