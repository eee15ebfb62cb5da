#!/usr/bin/env bash
# The shipped SFT scorer (262 traces, width 64) with Top-2L sampling at every budget, on the 192 held-out references;
# paired with its top-L rows of docs/results/smollm2-135m/heldout192 (runs/heldout192/eval, runs/heldout192/eval512). ~7 min per budget on 2 cores.
set -euo pipefail
export FORESIGHT_CACHE=runs/probe/cache R=recipes/smollm2-135m-realbench.yaml
S="--set eval.num_problems=192 --set eval.recall=false --set eval.scorer_selection=sample --methods full"
python -m foresight eval --recipe $R $S --budgets 128:32 --scorers scorers/smollm2-135m/sft --out runs/sample128/eval
python -m foresight eval --recipe $R $S --budgets 256:32,512:32 --scorers scorers/smollm2-135m/sft --out runs/sample128/eval256
foresight compare runs/heldout192/eval runs/sample128/eval --base-method foresight-sft --method foresight-sft
foresight compare runs/heldout192/eval runs/sample128/eval256 --base-method foresight-sft --method foresight-sft
foresight compare runs/heldout192/eval512 runs/sample128/eval256 --base-method foresight-sft --method foresight-sft
