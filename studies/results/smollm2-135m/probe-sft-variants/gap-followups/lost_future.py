"""The validation metrics of `foresight sft` (recall@L and the lost-future ratio, foresight.training.sft) for scorers that were
trained before the lost-future ratio existed, on the same 32 validation traces and stored golden examples.

    FORESIGHT_CACHE=runs/probe/cache python lost_future.py --traces runs/rb/traces --out lost.json SCORER_DIR ...
"""

import argparse
import json
from pathlib import Path

import torch

from foresight.scorers.checkpoint import load_scorer
from foresight.config.recipe import load_recipe
from foresight.training.golden_store import GoldenStore
from foresight.evaluation.report import bootstrap_ci
from foresight.training.sft import example_rows, lost_future_ratio, rows_loss
from foresight.data.stage_inputs import load_stage_inputs

ap = argparse.ArgumentParser()
ap.add_argument("scorers", nargs="+")
ap.add_argument("--traces", required=True)
ap.add_argument("--recipe", default="recipes/smollm2-135m-realbench.yaml")
ap.add_argument("--out", required=True)
a = ap.parse_args()
recipe = load_recipe(a.recipe, ["sft.val_traces=32"])
_, model, ds, _, val_idx = load_stage_inputs(recipe.sft, recipe.model, a.traces, 1)
cfg = recipe.sft
store = GoldenStore(model, recipe.cache, cfg.golden_pool, cfg.example_steps, cfg.seed)
rows = {}
for d in a.scorers:
    bank, _ = load_scorer(Path(d), model)
    lost, rec = [], []
    with torch.no_grad():
        for i in val_idx:
            rows = example_rows(bank, store.examples(ds[i], bank))
            lost.append(lost_future_ratio([(recipe.cache.interval, rows)]))
            rec.append(rows_loss(rows, cfg, recipe.cache.interval, torch.Generator().manual_seed(0))[1].mean().item())
    rows[d] = {"lost_future_ratio": sum(lost) / len(lost), "lost_future_ratio_ci": bootstrap_ci(lost),
               "recall_at_L": sum(rec) / len(rec), "per_trace_lost_future_ratio": lost}
    print(d, json.dumps({k: v for k, v in rows[d].items() if not k.startswith("per_trace")}), flush=True)
Path(a.out).write_text(json.dumps(rows, indent=1))
