#!/usr/bin/env bash
# The traces of the data-scaling study (studies/data_scaling.py): 1,088 SmolLM2 realbench traces decoded by
# vLLM's CPU build in bfloat16 (the recipe's dtype; 4.2x the in-process rate here, docs/results/smollm2-135m/vllm-traces/),
# every completion first, then the local scoring pass (the two share the machine's cores). Resumable: run it again.
# Needs .venv-vllm (make test-vllm installs it) and the exported model (make bench-traces exports it).
set -e
OUT=${SCALING_OUT:-runs/scaling}; PORT=${PORT:-8123}; MODEL=${MODEL:-$OUT/model-bfloat16}
[ -d "$MODEL" ] || .venv/bin/foresight export-model --recipe recipes/smollm2-135m-realbench.yaml --out "$MODEL"
mkdir -p "$OUT"
VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --enforce-eager --no-enable-chunked-prefill \
  --max-model-len 2048 --max-num-seqs 66 --disable-log-stats > "$OUT/vllm.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
until curl -s "127.0.0.1:$PORT/v1/models" > /dev/null; do kill -0 $SERVER || exit 1; sleep 2; done
.venv-vllm/bin/python -m studies.data_scaling --out "$OUT" --stages traces --set traces.engine=openai \
  --set "traces.base_url=http://127.0.0.1:$PORT/v1" --set traces.concurrency=66 --set traces.score_during_decoding=false
