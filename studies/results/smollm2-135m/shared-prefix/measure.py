"""Evaluation time with the part before the first eviction shared by every method of a budget (foresight.engine.cache.fork).

SmolLM2-135M (the realbench recipe, bfloat16), the first N held-out references (drawn by ``foresight eval`` and read
from its reference cache, FORESIGHT_CACHE), the recipe's budgets, the heuristics and the shipped scorer: each method's
teacher-forced rollout timed from token 0 and from the budget's shared prefixes (the prefix passes counted in), and
their losses compared bit for bit. Writes docs/results/smollm2-135m/shared-prefix/result.json.

    FORESIGHT_CACHE=... python studies/results/smollm2-135m/shared-prefix/measure.py [N [BUDGETS]]   # default 16, the recipe's
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
from foresight.data.references import make_batch, reference_traces
from foresight.evaluation.shared_prefixes import SharedPrefixes
from foresight.config.checks import parse_budgets

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
recipe = load_recipe("recipes/smollm2-135m-realbench.yaml", [f"eval.num_problems={n}"])
budgets = parse_budgets(sys.argv[2] if len(sys.argv) > 2 else recipe.eval.budgets)
model, tok = load_model(recipe.model)
problems = prompts.heldout_prompts(recipe.task, recipe.traces, n, tok)
refs = reference_traces(recipe, model, tok, problems, torch.device("cpu"), use_cache=True, progress=False)
batch = make_batch(refs, list(range(n)), tok.pad_token_id)
names = "streamingllm,h2o,tova,snapkv,rkv,scissorhands,knorm,keydiff,random"
meths = build_methods(names.split(","), [Path("scorers/smollm2-135m/sft-w256-gap")], model, False,
                      (recipe.kvpop.window, recipe.kvpop.sinks), ("topk", 1.0))
result = {"references": n, "tokens": int(batch["mask"].sum()), "mean_length": sum(batch["lengths"]) / n,
          "torch_threads": torch.get_num_threads(), "budgets": {}}
for B, L in budgets:
    prefixes = SharedPrefixes(model)
    row = {"from_token_0_s": 0.0, "shared_s": 0.0, "identical": [], "different": []}
    for m in meths:
        settings = m.settings(B, L, "evict")
        t0 = time.time()
        alone, _ = teacher_forced(m, model, batch, settings, 7)
        t1 = time.time()
        shared, _ = teacher_forced(m, model, batch, settings, 7, shared=prefixes.for_batch(0))
        t2 = time.time()
        row["from_token_0_s"] += t1 - t0
        row["shared_s"] += t2 - t1
        row["identical" if torch.equal(alone, shared) else "different"].append(m.name)
        print(B, m.name, round(t1 - t0, 1), round(t2 - t1, 1), flush=True)
    row |= {"prefix_passes": prefixes.built, "rollouts_served": prefixes.built + prefixes.reused,
            "from_token_0_s": round(row["from_token_0_s"], 1), "shared_s": round(row["shared_s"], 1),
            "saved": round(1 - row["shared_s"] / row["from_token_0_s"], 3)}
    result["budgets"][f"{B}:{L}"] = row
    print(B, row, flush=True)
DATA = Path(__file__).resolve().parents[4] / "docs/results/smollm2-135m/shared-prefix"  # the repository root's docs/results
(DATA / "result.json").write_text(json.dumps(result, indent=1) + "\n")
