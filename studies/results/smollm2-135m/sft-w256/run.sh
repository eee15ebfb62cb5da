# Width 256 against the shipped width 64 on the realbench recipe's 264 training traces (the last 32 held out for
# validation), then the held-out test on the 192 references of docs/results/smollm2-135m/heldout192/. The traces and the
# reference cache are those of ../sft-w64/run.sh (same seeds, batch 64); the width-64 rows come from docs/results/smollm2-135m/sft-w64/.
# 2-core AMD EPYC: SFT ~20 min per seed (a new seed first recomputes the stored golden examples, ~14 min), each
# validation evaluation ~3 min, the test evaluation at three budgets ~35 min.
set -e
export FORESIGHT_CACHE=${FORESIGHT_CACHE:-runs/probe/cache} R=recipes/smollm2-135m-realbench.yaml RB=runs/rb
python -m foresight traces --recipe $R --set traces.batch_size=64 --out $RB/traces
for S in 0 1; do
  python -m foresight sft --recipe $R --traces $RB/traces --set sft.val_traces=32 --set scorer.hidden=256 \
      --set sft.seed=$S --out $RB/sft-w256-s$S
  python -m foresight eval --recipe $R --traces $RB/traces --set sft.val_traces=32 --set eval.num_problems=32 \
      --set eval.recall=false --methods full --budgets 128:32,256:32 --scorers $RB/sft-w256-s$S --out $RB/val-w256-s$S
  python -m foresight compare docs/results/smollm2-135m/sft-w64/val/val-topk.json $RB/val-w256-s$S \
      --json $RB/compare-w256s$S-w64.json                  # val/compare-w256-w64.json for seed 0
done
python -m foresight compare $RB/val-w256-s0 $RB/val-w256-s1 --json $RB/compare-w256s1-w256s0.json
python -m foresight eval --recipe $R --set eval.num_problems=192 --set eval.recall=false --methods full \
    --budgets 128:32,256:32,512:32 --scorers $RB/sft-w256-s0 --out $RB/test-w256-topk
D=docs/results/smollm2-135m
python -m foresight compare $D/sft-w64/test-topk $RB/test-w256-topk --json $RB/test-w256-topk/compare/w256-minus-w64.json
for M in snapkv tova scissorhands random-keep-prompt; do
  python -m foresight compare $D/heldout192 $RB/test-w256-topk --base-method $M \
      --json $RB/test-w256-topk/compare/w256-minus-$M.json
done
for M in snapkv tova; do
  python -m foresight compare $D/heldout192/eval512-results.json $RB/test-w256-topk --base-method $M \
      --json $RB/test-w256-topk/compare/w256-minus-$M-512.json
done
python -m foresight compare $D/heldout192 $RB/test-w256-topk --base-method foresight-sft \
    --json $RB/test-w256-topk/compare/w256-minus-old-w16.json
