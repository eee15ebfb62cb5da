#!/usr/bin/env bash
# The data-scaling study end to end (studies/data_scaling.py; its report goes beside the other results): the traces
# through vLLM (traces.sh), then the golden examples, the SFT runs, the evaluation on the held-out references and the
# report in the project's environment. Every stage resumes after a kill: run it again.
set -e
OUT=${SCALING_OUT:-runs/scaling}
# a finished traces folder starts no server (with more prompts asked of it, run traces.sh itself)
[ -f "$OUT/traces/dataset/state.json" ] || bash "$(dirname "$0")/traces.sh"
.venv/bin/python -m studies.data_scaling --out "$OUT" --stages golden,sft,val,eval,headline,report
