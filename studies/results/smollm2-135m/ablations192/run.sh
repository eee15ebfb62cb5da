#!/usr/bin/env bash
# The paper's Table 5 ablations on SmolLM2-135M at B=256:32 on the 192 held-out references
# (docs/results/smollm2-135m/ablations192/).
# Needs the probe's 64 training traces and the width-64 SFT scorer trained on 48 of them (docs/results/smollm2-135m/probe-sft-variants/width256:
# runs/probe/traces, runs/probe/w64) and, to reuse the cached references and golden examples, its cache.
set -euo pipefail
mkdir -p runs/abl192
ln -sfn "$PWD/runs/probe/traces" runs/abl192/traces
ln -sfn "$PWD/runs/probe/w64" runs/abl192/sft
export FORESIGHT_CACHE=runs/probe/cache
python -m studies.realbench.run --recipe recipes/smollm2-135m-realbench.yaml \
  --out runs/abl192 --report docs/results/smollm2-135m/ablations192 --stages eval,ablations,report \
  --set sft.steps=200 --set sft.val_traces=16 \
  --set eval.num_problems=192 --set eval.recall=false --set eval.budgets=256:32 --set eval.methods=full
# paired against the heuristics of the 192-reference evaluation (docs/results/smollm2-135m/heldout192), e.g.
#   foresight compare runs/heldout192/eval runs/abl192/eval-ablations-shared --base-method snapkv --method 'foresight-sft(kv-only)'
