"""Decoding time of generation's full cache: transformers' StaticCache (before) against foresight's PreallocatedCache.

SmolLM2-135M (the realbench recipe: bfloat16, its sampling), the first ROWS realbench prompts in one batch, NEW sampled
tokens each (row-seeded), timed with each cache in turn; writes docs/results/smollm2-135m/full-cache/result.json.

    python studies/results/smollm2-135m/full-cache/measure.py [ROWS NEW]     # default 64 1024 (~11 min on 2 cores)
"""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import StaticCache

import foresight.engine.cache.full
import foresight.engine.generate as G
from foresight.config.recipe import load_recipe
from foresight.engine.models import load_model

rows_n, new_n = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (64, 1024)
recipe = load_recipe("recipes/smollm2-135m-realbench.yaml", [])
model, tok = load_model(recipe.model)
rows = [json.loads(line) for line in open("data_prep/prompts/realbench.jsonl")][:rows_n]
texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True)
         for r in rows]
enc = tok(texts, return_tensors="pt", padding=True)
decoding = G.Decoding.from_recipe(recipe.traces, tok)
caches = {"StaticCache": lambda config, capacity: StaticCache(config=config, max_cache_len=capacity),
          "PreallocatedCache": foresight.engine.cache.full.PreallocatedCache}
result, tokens = {"rows": rows_n, "new_tokens": new_n, "prompt_tokens_padded": enc.input_ids.shape[1]}, {}
for name, make in caches.items():
    G.PreallocatedCache = make  # what generate() builds for the full cache
    gens = [torch.Generator().manual_seed(i) for i in range(rows_n)]
    t0 = time.time()
    out = G.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=new_n, decoding=decoding,
                     options=G.GenerateOptions(row_generators=gens))
    seconds = time.time() - t0
    tokens[name] = out.new_tokens
    result[name] = {"seconds": round(seconds, 1), "tokens_per_s": round(rows_n * new_n / seconds, 1)}
    print(name, result[name], flush=True)
same = (tokens["StaticCache"] == tokens["PreallocatedCache"]).long().cumprod(1).sum(1)
result["rows_identical"] = int((same == new_n).sum())
result["tokens_before_first_difference_median"] = float(same.float().median())
DATA = Path(__file__).resolve().parents[4] / "docs/results/smollm2-135m/full-cache"  # the repository root's docs/results
(DATA / "result.json").write_text(json.dumps(result, indent=1) + "\n")
print(result)
