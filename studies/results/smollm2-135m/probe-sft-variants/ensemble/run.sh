#!/usr/bin/env bash
# The ensemble probe (docs/results/smollm2-135m/probe-sft-variants/ensemble/README.md): the two shipped width-256 scorers and their rank mean on the
# 48 held-out references, B = 128 and 256, loss ratio only; then the paired comparisons. ~16 min on 2 cores.
set -euo pipefail
D=docs/results/smollm2-135m/probe-sft-variants/ensemble  # the data
H=studies/results/smollm2-135m/probe-sft-variants/ensemble  # this script's folder
OUT=${OUT:-runs/ensemble}
export FORESIGHT_CACHE=${FORESIGHT_CACHE:-$OUT/cache}
python $H/ensemble_eval.py --recipe recipes/smollm2-135m-realbench.yaml --set eval.recall=false --methods full \
  --budgets 128:32,256:32 --scorers scorers/smollm2-135m/sft-w256-gap \
  --scorers scorers/smollm2-135m/sft-w256 --out $OUT/eval
python -m foresight compare $OUT/eval $OUT/eval --base-method foresight-sft --method foresight-ensemble --json $D/compare-ensemble.json
python -m foresight compare $OUT/eval $OUT/eval --base-method foresight-sft --method 'foresight-sft(sft-w256)' --json $D/compare-uniform.json
