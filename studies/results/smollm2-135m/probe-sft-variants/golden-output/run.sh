# docs/results/smollm2-135m/probe-sft-variants/golden-output/: golden eviction under its value-aware pooling (sft.golden_pool=output) against its default (mean), on
# the 32 validation traces of the realbench recipe (the last 32 of the 264 training traces of ../../grpo-noise/run.sh).
# 2-core Intel Xeon with AMX, commit a244a89. ~2 min (mean) and ~4 min (output) per evaluation.
export FORESIGHT_CACHE=runs/s35/cache R=recipes/smollm2-135m-realbench.yaml T=runs/rb/traces O=runs/s35
V="--recipe $R --traces $T --set sft.val_traces=32 --set eval.num_problems=32 --set eval.recall=false --budgets 128:32,256:32"
python -m foresight eval $V --methods full,golden --out $O/val-golden-mean
python -m foresight eval $V --methods full,golden --set sft.golden_pool=output --out $O/val-golden-output
python -m foresight compare $O/val-golden-mean $O/val-golden-output --base-method golden --method golden \
    --json docs/results/smollm2-135m/probe-sft-variants/golden-output/val-golden-output-minus-mean.json
