# 384 sampled held-out references of the realbench recipe; the shipped width-256 scorer against random-keep-prompt,
# the one heuristic whose interval its own still touched on 192 references (B=256), and at B=512, where that method
# had not been evaluated on a large set. docs/results/smollm2-135m/heldout384/; commit 202ad57, 2-core AMD EPYC (AVX-512 BF16, no AMX).
# The references take ~60 min (4 batches of 96), each method ~10 min (random-keep-prompt) or ~20 min (the scorer)
# per budget. The second command extends the first's folder (only the B=512 rows are computed).
set -e
export FORESIGHT_CACHE=${FORESIGHT_CACHE:-runs/probe/cache} R=recipes/smollm2-135m-realbench.yaml
S=scorers/smollm2-135m/sft-w256 E=runs/h384/eval
COMMON="--recipe $R --set eval.num_problems=384 --set traces.batch_size=96 --set eval.recall=false --scorers $S --out $E"
python -m foresight eval $COMMON --methods full,random-keep-prompt --budgets 256:32
python -m foresight eval $COMMON --methods full,random-keep-prompt --budgets 256:32,512:32
python -m foresight compare $E $E --base-method random-keep-prompt --method foresight-sft --json $E/sft-minus-rkp.json
python -m foresight eval --recipe $R --set eval.num_problems=384 --set traces.batch_size=64 --set eval.recall=false --methods full,random-keep-prompt --budgets 256:32 --out runs/h384/eval-rkp-b64
