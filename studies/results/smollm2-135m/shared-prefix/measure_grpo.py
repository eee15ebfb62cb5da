"""GRPO's group rollout with its G rows fed as one row up to the first eviction (foresight.engine.cache.fork) against G rows
from token 0.

SmolLM2-135M (the realbench recipe, bfloat16), the first N realbench training traces (``runs/rb/traces`` or the
folder given), the shipped scorer ``sft-w256-gap``, the recipe's G, budget and sampler temperature: each trace's
group rollout timed both ways with the same generator seed; the drawn evictions and the losses compared. Appends to
docs/results/smollm2-135m/shared-prefix/result.json.

    python studies/results/smollm2-135m/shared-prefix/measure_grpo.py [N [TRACES [DTYPE]]]   # 4 runs/rb/traces bfloat16

In bfloat16 the drawn trajectories differ: a matmul of 1 row and one of 8 round differently on this CPU (the keys at
the first eviction differ by up to 0.4 after layer 0, while the 8 rows of one batch equal each other); in float32
they are the same draws and losses (DTYPE float32).
"""

import json
import sys
import time
from pathlib import Path

import torch

import foresight.training.grpo.rollout as gr
from foresight.scorers.checkpoint import load_scorer
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import load_recipe
from foresight.engine.models import load_model
from foresight.data.trace_data import load_traces

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
traces = Path(sys.argv[2] if len(sys.argv) > 2 else "runs/rb/traces")
dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
recipe = load_recipe("recipes/smollm2-135m-realbench.yaml", [f"model.dtype={dtype}"])
model, _ = load_model(recipe.model)
bank, _ = load_scorer(Path("scorers/smollm2-135m/sft-w256-gap"), model)
bank.eval()
ds = load_traces(traces)
settings = EvictionSettings(budget=recipe.cache.budget, interval=recipe.cache.interval)
G, T = recipe.grpo.group, recipe.grpo.temperature
real_prefix = gr.shared_prefix
out = {"dtype": dtype, "traces": n, "group": G, "budget": settings.budget, "interval": settings.interval, "seconds": {},
       "same_draws": 0, "max_loss_difference": 0.0}
for mode in ("from_token_0", "shared_prefix"):
    gr.shared_prefix = real_prefix if mode == "shared_prefix" else (lambda *a, **k: None)
    t0, runs = time.time(), []
    for i in range(n):
        row = ds[i]
        ids = torch.tensor([row["input_ids"]])
        res, steps, _ = gr.group_rollout(model, bank, ids, gr.GroupSampling(G, T, recipe.grpo.ratio), settings,
                                         torch.Generator().manual_seed(i), row["prompt_len"])
        runs.append((res.token_loss, [s["pos"] for s in steps]))
    out["seconds"][mode] = round(time.time() - t0, 1)
    out.setdefault("tokens", sum(len(ds[i]["input_ids"]) for i in range(n)))
    if mode == "from_token_0":
        base = runs
    print(mode, out["seconds"][mode], flush=True)
for (la, pa), (lb, pb) in zip(base, runs):
    out["same_draws"] += int(len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb)))
    out["max_loss_difference"] = max(out["max_loss_difference"], float((la - lb).abs().max()))
out["saved"] = round(1 - out["seconds"]["shared_prefix"] / out["seconds"]["from_token_0"], 3)
f = Path(__file__).resolve().parents[4] / "docs/results/smollm2-135m/shared-prefix/result.json"
result = json.loads(f.read_text()) if f.exists() else {}
result.pop("grpo_group_rollout", None)  # (a first run's key, before DTYPE)
result[f"grpo_group_rollout_{dtype}"] = out
f.write_text(json.dumps(result, indent=1) + "\n")
print(out)
