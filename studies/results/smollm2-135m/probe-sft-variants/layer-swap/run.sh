# docs/results/smollm2-135m/probe-sft-variants/layer-swap/: golden's decisions swapped in for the SFT scorer's in chosen layers / KV heads, on the 32 validation
# traces of the realbench recipe (runs/rb/traces: the 264 training traces of ../../grpo-noise/run.sh, the last 32
# validating) with the recipe's SFT scorer of ../heads/run.sh (runs/s34/sft-base). 2-core Intel Xeon with AMX, commit 5d12aee.
export FORESIGHT_CACHE=runs/s35/cache
P=docs/results/smollm2-135m/probe-sft-variants/layer-swap  # the data
H=studies/results/smollm2-135m/probe-sft-variants/layer-swap  # this script's folder
python $H/swap.py runs/s34/sft-base $P/groups-of-5.json 5 128,256           # ~32 min
python $H/swap.py runs/s34/sft-base $P/single-layers-15-24.json 15-24 128  # ~7 min
python $H/layer18.py runs/s34/sft-base $P/layer18.json                     # ~4 min
python $H/layer18.py runs/s34/sft-base $P/heads.json heads                 # ~7 min
python $H/headbudget.py runs/s34/sft-base $P/headbudget.json                 # ~14 min (simulated per-head budgets)
# the heuristics at B = 256 on the same traces (uniform budget, the engine's own): the 2B comparison
export R=recipes/smollm2-135m-realbench.yaml
python -m foresight eval --recipe $R --traces runs/rb/traces --set sft.val_traces=32 --set eval.num_problems=32 \
    --set eval.recall=false --budgets 256:32 --methods full,random-keep-prompt,snapkv,scissorhands,tova,lookahead,streamingllm,h2o \
    --out $P/val-heur256
