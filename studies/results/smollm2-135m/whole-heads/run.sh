#!/usr/bin/env bash
# docs/results/smollm2-135m/whole-heads/: layer 18's KV head 2 kept whole (cache.whole_heads=18:2) for every method, at the budgets that hold the
# memory of B=128 and 256 at the end of the longest reference, less one (114 and 242: its 1,166 pairs / 90 heads = 13
# per head), on the 48 held-out references of docs/results/smollm2-135m/all-methods/ (the same reference cache, so rows pair with its uniform
# rows). 2-core Intel Xeon with AMX; ~11 min. Then the validation-trace check against the probe's simulation and the
# head search on the validation traces.
set -euo pipefail
D=docs/results/smollm2-135m/whole-heads  # the data
H=studies/results/smollm2-135m/whole-heads  # this script's folder
R=recipes/smollm2-135m-realbench.yaml
OUT=${OUT:-runs/whole-heads}
FORESIGHT_CACHE=${REF_CACHE:-runs/s32/cache} python -m foresight eval --recipe $R \
  --scorers scorers/smollm2-135m/sft-w256-gap --out $OUT/heldout \
  --set cache.whole_heads=18:2 --set eval.recall=false --budgets 114:32,242:32 \
  --methods full,golden,random-keep-prompt,streamingllm,tova,snapkv,scissorhands,lookahead
cp $OUT/heldout/results.json $OUT/heldout/meta.json $D/
python $H/summarise.py
# the 32 validation traces (runs/rb/traces, the realbench training traces; the scorer runs/s34/sft-base of ../probe-sft-variants/heads/run.sh):
# the engine's whole head against the probe's simulated per-head budgets (../probe-sft-variants/layer-swap/)
for W in "--set cache.whole_heads=18:2" ""; do
  FORESIGHT_CACHE=${VAL_CACHE:-runs/s35/cache} python -m foresight eval --recipe $R --traces runs/rb/traces \
    --set sft.val_traces=32 --set eval.num_problems=32 --set eval.recall=false $W \
    --scorers runs/s34/sft-base --methods full,tova --budgets 116:32,128:32 --out $OUT/val${W:+-whole}
done
# the search that finds the head from the validation traces alone
FORESIGHT_CACHE=${VAL_CACHE:-runs/s35/cache} python -m foresight heads --recipe $R --traces runs/rb/traces \
  --set sft.val_traces=32 --set eval.num_problems=32 \
  --scorers scorers/smollm2-135m/sft-w256-gap --budgets 128:32 --out $OUT/heads
cp $OUT/heads/heads.json $D/
# per-layer budgets, simulated (masking; ~12 min)
FORESIGHT_CACHE=${VAL_CACHE:-runs/s35/cache} python $H/layerbudget.py runs/s34/sft-base $D/layerbudget.json
# the same search for TOVA (~10 min)
FORESIGHT_CACHE=${VAL_CACHE:-runs/s35/cache} python -m foresight heads --recipe $R --traces runs/rb/traces \
  --set sft.val_traces=32 --set eval.num_problems=32 --method tova --budgets 128:32 --out $OUT/heads-tova
cp $OUT/heads-tova/heads.json $D/heads-tova.json
# the recommended scorer on 192 held-out references (the first 48 from the cache above, 144 more drawn; ~30 min)
mkdir -p $OUT/cache192 && cp -rn ${REF_CACHE:-runs/s32/cache}/references $OUT/cache192/
for W in "" "--set cache.whole_heads=18:2"; do
  FORESIGHT_CACHE=$OUT/cache192 python -m foresight eval --recipe $R --scorers scorers/smollm2-135m/sft-w256-gap \
    --set eval.num_problems=192 --set eval.recall=false $W --methods full \
    --budgets $([ -z "$W" ] && echo 128:32,256:32 || echo 114:32,242:32) --out $OUT/heldout192${W:+-whole}
done
