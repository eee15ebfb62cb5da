set -e
export FORESIGHT_CACHE=runs/probe/cache R=recipes/smollm2-135m-realbench.yaml
/usr/bin/time -f "eval %e s" .venv/bin/python -m foresight eval --recipe $R --set eval.num_problems=192 --set traces.batch_size=72 \
  --set eval.recall=false --methods full,random-keep-prompt,streamingllm,tova,snapkv,scissorhands --budgets 128:32,256:32 \
  --scorers scorers/smollm2-135m/sft --out runs/heldout192/eval
