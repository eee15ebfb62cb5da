"""Recall@L of scorers on golden's states vs on the width-64 scorer's own states (the 16 validation traces)."""
import sys
import torch
from foresight.config.recipe import load_recipe
from foresight.scorers.checkpoint import load_scorer
from foresight.training.golden_store import GoldenStore
from foresight.engine.models import load_model
from foresight.data.trace_data import load_traces
from foresight.training.sft import example_loss
from foresight.evaluation.report import bootstrap_ci
r = load_recipe("recipes/smollm2-135m-realbench.yaml", ["traces.num_prompts=64", "sft.val_traces=16"])
model, _ = load_model(r.model)
ds = load_traces("runs/probe/traces")
val = list(range(len(ds) - 16, len(ds)))
behaviour, _ = load_scorer("runs/probe/v-width64", model)
gold = GoldenStore(model, r.cache, "mean", r.sft.example_steps, r.sft.seed)
own = GoldenStore(model, r.cache, "mean", r.sft.example_steps, r.sft.seed, behaviour=behaviour)
for name in sys.argv[1:]:
    bank, _ = load_scorer(f"runs/probe/v-{name}", model)
    for label, st in (("golden states", gold), ("width64's states", own)):
        with torch.no_grad():
            rec = [example_loss(bank, st.examples(ds[i], bank), r.sft, r.cache.interval,
                                torch.Generator().manual_seed(0))[1].mean().item() for i in val]
        lo, hi = bootstrap_ci(rec)
        print(f"{name:10s} {label:18s} recall@L {sum(rec)/len(rec):.4f} [{lo:.4f}, {hi:.4f}]", flush=True)
