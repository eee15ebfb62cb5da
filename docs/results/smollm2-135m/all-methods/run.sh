#!/usr/bin/env bash
# Session 32: every method of the realbench recipe at its three budgets, with recall, against the recommended SmolLM2
# scorer on the recipe's 48 held-out references, in one evaluation (README.md beside this file). ~25 min per budget at
# B = 128 and 256 on 2 cores, B = 512 longer (golden's recall pass alone > 27 min); references ~7 more when not cached.
set -euo pipefail
D=docs/results/smollm2-135m/all-methods
OUT=${OUT:-runs/all-methods}
export FORESIGHT_CACHE=${FORESIGHT_CACHE:-$OUT/cache}
python -m foresight eval --recipe recipes/smollm2-135m-realbench.yaml \
  --scorers docs/results/smollm2-135m/scorers/sft-w256-gap --out $OUT/eval
cp $OUT/eval/results.json $OUT/eval/meta.json $D/
python $D/summarise.py $D/results.json
