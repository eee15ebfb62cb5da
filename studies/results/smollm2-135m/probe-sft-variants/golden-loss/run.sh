# docs/results/smollm2-135m/probe-sft-variants/golden-loss/: golden eviction under the first-order loss pooling (sft.golden_pool=loss, foresight/targets/golden_loss.py)
# against its default (mean: block-mean future attention), on the 32 validation traces of the realbench recipe (the
# last 32 of the 264 training traces of ../../grpo-noise/run.sh). 2-core Intel Xeon with AMX; ~5 min per evaluation.
# The default row is that of ../golden-output/run.sh (docs/results/smollm2-135m/probe-sft-variants/golden-output/val-golden-mean, same traces, same engine).
export FORESIGHT_CACHE=runs/s35/cache R=recipes/smollm2-135m-realbench.yaml T=runs/rb/traces O=runs/s36
V="--recipe $R --traces $T --set sft.val_traces=32 --set eval.num_problems=32 --set eval.recall=false --budgets 128:32,256:32"
python -m foresight eval $V --methods full,golden --set sft.golden_pool=loss --out $O/val-golden-loss
python -m foresight compare runs/s35/val-golden-mean $O/val-golden-loss --base-method golden --method golden \
    --json docs/results/smollm2-135m/probe-sft-variants/golden-loss/val-golden-loss-minus-mean.json
# The two variants measured before the kept one (same command, code of an uncommitted working tree, not kept):
# signed costs summed over the future blocks ("signed-sum"), and magnitudes summed over them ("abs-sum").
