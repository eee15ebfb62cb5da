#!/usr/bin/env bash
# Every method of the realbench recipe at its three budgets, with recall, against the recommended SmolLM2
# scorer on the recipe's 48 held-out references, in one evaluation (docs/results/smollm2-135m/all-methods/README.md). ~25 min per budget at
# B = 128 and 256 on 2 cores, B = 512 longer (golden's recall pass alone > 27 min); references ~7 more when not cached.
set -euo pipefail
D=docs/results/smollm2-135m/all-methods  # the data
H=studies/results/smollm2-135m/all-methods  # this script's folder
OUT=${OUT:-runs/all-methods}
export FORESIGHT_CACHE=${FORESIGHT_CACHE:-$OUT/cache}
python -m foresight eval --recipe recipes/smollm2-135m-realbench.yaml \
  --scorers scorers/smollm2-135m/sft-w256-gap --out $OUT/eval
cp $OUT/eval/results.json $OUT/eval/meta.json $D/
PYTHONPATH=. python $H/summarise.py $D/results.json  # it imports studies.realbench
