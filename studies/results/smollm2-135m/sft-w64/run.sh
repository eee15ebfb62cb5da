# The realbench recipe's width-64 SFT scorer on its 264 training traces (the last 32 held out for validation), the
# sampler chosen on those 32 validation traces, then the held-out test on the 192 references of docs/results/smollm2-135m/heldout192/.
# 2-core CPU: traces ~37 min (64 of them reused from runs/probe), SFT ~17 min (golden examples included), each
# validation evaluation ~3 min, each test evaluation at 3 budgets ~22 min.
set -e
export FORESIGHT_CACHE=${FORESIGHT_CACHE:-runs/probe/cache} R=recipes/smollm2-135m-realbench.yaml RB=runs/rb
python -m foresight traces --recipe $R --set traces.batch_size=64 --out $RB/traces   # batch 64: reuses runs/probe/traces' parts
python -m foresight sft --recipe $R --traces $RB/traces --set sft.val_traces=32 --out $RB/sft
V="--recipe $R --traces $RB/traces --set sft.val_traces=32 --set eval.num_problems=32 --set eval.recall=false --methods full --budgets 128:32,256:32 --scorers $RB/sft"
python -m foresight eval $V --out $RB/val-topk
for T in 0.005 0.01 0.02 0.05 0.1; do
  python -m foresight eval $V --set eval.scorer_selection=sample --set eval.scorer_temperature=$T --out $RB/val-sample-$T
done
python -m foresight eval $V --set eval.scorer_selection=multinomial --out $RB/val-multinomial
X="--recipe $R --set eval.num_problems=192 --set eval.recall=false --methods full --budgets 128:32,256:32,512:32 --scorers $RB/sft"
python -m foresight eval $X --out $RB/test-topk
python -m foresight eval $X --set eval.scorer_selection=sample --set eval.scorer_temperature=0.02 --out $RB/test-sample-0.02
# paired differences: foresight compare runs/heldout192/eval $RB/test-topk --base-method snapkv --method foresight-sft ...
