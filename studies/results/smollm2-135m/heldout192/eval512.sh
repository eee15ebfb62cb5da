set -e
export FORESIGHT_CACHE=runs/probe/cache R=recipes/smollm2-135m-realbench.yaml
S="--set eval.num_problems=192 --set traces.batch_size=72 --set eval.recall=false --budgets 512:32 --scorers scorers/smollm2-135m/sft --out runs/heldout192/eval512"
/usr/bin/time -f "eval512a %e s" .venv/bin/python -m foresight eval --recipe $R $S --methods full
/usr/bin/time -f "eval512b %e s" .venv/bin/python -m foresight eval --recipe $R $S --methods full,snapkv,tova
