#!/usr/bin/env bash
# docs/results/smollm2-135m/layer-budgets/: per-layer budgets (cache.layer_budgets) in the engine, on 48 held-out references drawn on this machine
# (2-core AMD EPYC with AVX-512 BF16, no AMX: its references differ from the AMX machine's, so every row here, the
# uniform ones included, comes from this run). Layers 15-24 get twice the share of the others (at B=128: 192 and 96,
# the allocation of docs/results/smollm2-135m/whole-heads/, chosen on validation traces by simulation with ../whole-heads/layerbudget.py),
# alone and
# with layer 18's KV head 2 whole at B'=114 / 242 (docs/results/smollm2-135m/whole-heads/: the memory of B=128 / 256 at the end of the
# longest reference). ~60 min on this machine.
set -euo pipefail
D=docs/results/smollm2-135m/layer-budgets  # the data
H=studies/results/smollm2-135m/layer-budgets  # this script's folder
R=recipes/smollm2-135m-realbench.yaml
S=scorers/smollm2-135m/sft-w256-gap
OUT=${OUT:-runs/layer-budgets}
export FORESIGHT_CACHE=${REF_CACHE:-$OUT/cache}
ev() { python -m foresight eval --recipe $R --scorers $S --set eval.recall=false "$@"; }
ev --out $OUT/uniform --budgets 128:32,256:32,512:32 --methods full,random-keep-prompt,scissorhands,tova
ev --out $OUT/layers --budgets 128:32,256:32 --methods full,random-keep-prompt,scissorhands,tova \
  --set cache.layer_budgets=15-24:2
ev --out $OUT/whole --budgets 114:32,242:32 --methods full --set cache.whole_heads=18:2
ev --out $OUT/layers-whole --budgets 114:32,242:32 --methods full \
  --set cache.layer_budgets=15-24:2 --set cache.whole_heads=18:2
# the scorer with the prompt protected on top of B, as random-keep-prompt keeps it (at 128 the prompts
# longer than B are evicted as usual: prompt_overflow=evict)
for LB in "" "--set cache.layer_budgets=15-24:2"; do
  ev --out $OUT/prompt${LB:+-layers} --budgets 128:32,256:32 --methods full --set eval.protect_prompt=true \
    --set cache.prompt_overflow=evict $LB
done
for r in uniform layers whole layers-whole prompt prompt-layers; do mkdir -p $D/$r && cp $OUT/$r/results.json $OUT/$r/meta.json $D/$r/; done
python $H/summarise.py
# the search on validation traces drawn anew (the realbench's training traces; their last 32 validate)
python -m foresight traces --recipe $R --out $OUT/traces
FORESIGHT_CACHE=$OUT/valcache python -m foresight heads --recipe $R --traces $OUT/traces --set sft.val_traces=32 \
  --set eval.num_problems=32 --scorers $S --budgets 128:32 --out $OUT/heads
cp $OUT/heads/heads.json $D/
# the layer shares at B=256 on the same validation traces
for LB in "" "--set cache.layer_budgets=15-24:2"; do
  FORESIGHT_CACHE=$OUT/valcache ev --set eval.traces=$OUT/traces --set sft.val_traces=32 --set eval.num_problems=32 \
    --budgets 256:32 --methods full $LB --out $OUT/val256/$([ -z "$LB" ] && echo uniform || echo layers-2)
done
FORESIGHT_CACHE=$OUT/valcache ev --set eval.traces=$OUT/traces --set sft.val_traces=32 --set eval.num_problems=32 \
  --budgets 243:32 --methods full --set cache.layer_budgets=15-24:2 --set cache.whole_heads=18:2 --out $OUT/val256/layers-whole
# the prompt on top (as random-keep-prompt keeps it), layer shares and the whole head together, and the
# Top-2L sampler (T=0.02, chosen on validation traces in docs/results/smollm2-135m/sft-w64/) with the allocation; same 48 references
LW="--set cache.layer_budgets=15-24:2 --set cache.whole_heads=18:2"
P="--set eval.protect_prompt=true --set cache.prompt_overflow=evict"
SMP="--set eval.scorer_selection=sample --set eval.scorer_temperature=0.02"
ev --out $OUT/prompt-layers-whole --budgets 114:32,242:32 --methods full $LW $P
ev --out $OUT/layers-whole-sample --budgets 114:32,242:32 --methods full $LW $SMP
ev --out $OUT/prompt-layers-whole-sample --budgets 114:32 --methods full $LW $P $SMP
# ... and the headline at B'=242 on 192 references (144 more drawn into the same reference cache): the scorer with the
# prompt on top and the allocation against random-keep-prompt at a uniform 512, and at 484 with the same allocation
ev --set eval.num_problems=192 --out $OUT/r192/prompt-layers-whole --budgets 242:32 --methods full $LW $P
python -m foresight eval --recipe $R --set eval.recall=false --set eval.num_problems=192 --out $OUT/r192/uniform \
  --budgets 512:32 --methods full,random-keep-prompt
python -m foresight eval --recipe $R --set eval.recall=false --set eval.num_problems=192 --out $OUT/r192/layers-whole-rkp \
  --budgets 484:32 --methods full,random-keep-prompt $LW
for r in prompt-layers-whole layers-whole-sample prompt-layers-whole-sample r192/prompt-layers-whole r192/uniform \
  r192/layers-whole-rkp; do mkdir -p $D/$r && cp $OUT/$r/results.json $OUT/$r/meta.json $D/$r/; done
python $H/summarise.py
# the search at B=256 on the scorer's 32 validation prompts (rows 232-263), drawn anew as a folder of 32
# traces: SFT's split holds out a quarter of a folder, so it measured 8 (heads256-8traces.json)
sed -n 233,264p data_prep/prompts/realbench.jsonl > $OUT/valprompts.jsonl
python -m foresight traces --recipe $R --set traces.prompt_dataset=$OUT/valprompts.jsonl --set traces.num_prompts=32 \
  --set traces.batch_size=32 --out $OUT/valtraces
FORESIGHT_CACHE=$OUT/valcache python -m foresight heads --recipe $R --traces $OUT/valtraces --set sft.val_traces=32 \
  --set eval.num_problems=32 --scorers $S --budgets 256:32 --out $OUT/heads256
cp $OUT/heads256/heads.json $D/heads256-8traces.json
# ... and on 32 validation traces: a 128-trace folder (prompts 136-263), whose last quarter is the 32 (heads256.json)
sed -n 137,264p data_prep/prompts/realbench.jsonl > $OUT/valprompts128.jsonl
python -m foresight traces --recipe $R --set traces.prompt_dataset=$OUT/valprompts128.jsonl --set traces.num_prompts=128 \
  --set traces.batch_size=64 --out $OUT/valtraces128
FORESIGHT_CACHE=$OUT/valcache128 python -m foresight heads --recipe $R --traces $OUT/valtraces128 --set sft.val_traces=32 \
  --set eval.num_problems=32 --scorers $S --budgets 256:32 --out $OUT/heads256b
cp $OUT/heads256b/heads.json $D/heads256.json
