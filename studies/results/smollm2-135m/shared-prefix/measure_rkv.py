"""R-KV's redundancy in slices of rows (foresight.policies.rkv) against the whole-matrix computation it replaced.

SmolLM2-135M (the realbench recipe, bfloat16), the first N held-out references from the evaluation's reference cache
(FORESIGHT_CACHE), R-KV's teacher-forced rollout at each budget with either redundancy; losses compared bit for bit.
Appends to docs/results/smollm2-135m/shared-prefix/result.json.

    FORESIGHT_CACHE=... python studies/results/smollm2-135m/shared-prefix/measure_rkv.py [N [BUDGETS]]   # 16 256:32,512:32
"""

import json
import sys
import time
from pathlib import Path

import torch

from foresight.data import prompts
from foresight.config.recipe import load_recipe
from foresight.evaluation.evaluate import teacher_forced
from foresight.evaluation.methods import build_methods
from foresight.engine.models import load_model
from foresight.policies import rkv
from foresight.data.references import make_batch, reference_traces
from foresight.config.checks import parse_budgets


def whole_matrix_redundancy(keys, valid, threshold=0.5):
    """The computation before: every [n, n] matrix of all layers at once, with [n, n] masks."""
    k = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = k @ k.transpose(-1, -2)
    n = sim.shape[-1]
    pair_ok = valid.unsqueeze(-1) & valid.unsqueeze(-2) & ~torch.eye(n, dtype=torch.bool, device=sim.device)
    sim = torch.where(pair_ok & (sim >= threshold), sim, torch.zeros_like(sim))
    later = torch.triu(torch.ones(n, n, dtype=torch.bool, device=sim.device), diagonal=1)
    red = torch.where(((sim > 0) & later).any(-1), sim.sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1),
                      torch.zeros((), device=sim.device))
    return red.masked_fill(~valid, float("-inf")).softmax(-1).nan_to_num(0.0)


n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
budgets = parse_budgets(sys.argv[2] if len(sys.argv) > 2 else "256:32,512:32")
recipe = load_recipe("recipes/smollm2-135m-realbench.yaml", [f"eval.num_problems={n}"])
model, tok = load_model(recipe.model)
refs = reference_traces(recipe, model, tok, prompts.heldout_prompts(recipe.task, recipe.traces, n, tok), torch.device("cpu"),
                        use_cache=True, progress=False)
batch = make_batch(refs, list(range(n)), tok.pad_token_id)
(method,) = build_methods(["rkv"], [], model, False, (recipe.kvpop.window, recipe.kvpop.sinks), ("topk", 1.0))
sliced = rkv.redundancy
out = {"references": n}
for B, L in budgets:
    row, losses = {}, {}
    for name, fn in (("whole_matrix_s", whole_matrix_redundancy), ("sliced_s", sliced)):
        rkv.redundancy = fn
        t0 = time.time()
        losses[name], _ = teacher_forced(method, model, batch, method.settings(B, L, "evict"), 7)
        row[name] = round(time.time() - t0, 1)
        print(B, name, row[name], flush=True)
    row["identical_losses"] = torch.equal(*losses.values())
    out[f"{B}:{L}"] = row
rkv.redundancy = sliced
f = Path(__file__).resolve().parents[4] / "docs/results/smollm2-135m/shared-prefix/result.json"
result = json.loads(f.read_text()) if f.exists() else {}
result["rkv_rollout"] = out
f.write_text(json.dumps(result, indent=1) + "\n")
print(out)
