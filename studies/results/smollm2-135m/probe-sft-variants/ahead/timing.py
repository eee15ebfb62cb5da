"""Cost of `ahead` in a teacher-forced rollout (docs/results/smollm2-135m/probe-sft-variants/ahead/): the recipe's
scorer against the `ahead` scorer on 16 validation traces at B=128, L=32 (batched, the evaluation's path), best of 2
runs each, alone on 2 cores.

    python studies/results/smollm2-135m/probe-sft-variants/ahead/timing.py runs/s34/sft-base runs/s35/sft-ahead
"""
import sys
import time

import torch

from foresight.scorers.checkpoint import load_scorer
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import load_recipe
from foresight.engine.models import load_model
from foresight.data.prompts import pad_rows
from foresight.engine.rollout import rollout
from foresight.scorers.bank import LearnedPolicy
from foresight.data.trace_data import load_traces

r = load_recipe("recipes/smollm2-135m-realbench.yaml", [])
model, _ = load_model(r.model)
ds = load_traces("runs/rb/traces")
rows = [ds[i]["input_ids"] for i in range(248, 264)]
ids, mask = pad_rows(rows, 0, "cpu", side="right")
settings = EvictionSettings(budget=128, interval=32)
for path in sys.argv[1:]:
    bank, _ = load_scorer(path, model)
    pol = LearnedPolicy(bank)
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        with torch.no_grad():
            rollout(model, ids, pol, settings, attention_mask=mask)
        best = min(best, time.perf_counter() - t)
    print(f"{path}: features {list(bank.features)}, rollout of {len(rows)} traces at B=128: {best:.1f} s (best of 2)")
