# docs/results/smollm2-135m/grpo-noise/: the gradient noise scale of GRPO's objective at the SFT start (python -m studies.grpo_noise), on
# SmolLM2-135M (the realbench's 264 training traces of `foresight traces --set traces.batch_size=64`, the recommended
# gap-weighted SFT scorer) and, for contrast, on the tiny teacher (the demo's traces and SFT scorer), where GRPO at
# 8 traces per step measurably helps. 2-core Intel CPU with AMX, bfloat16 for SmolLM2.
set -e
R=recipes/smollm2-135m-realbench.yaml
python -m foresight traces --recipe $R --set traces.batch_size=64 --out runs/rb/traces
python -m studies.grpo_noise --recipe $R --traces runs/rb/traces --init scorers/smollm2-135m/sft-w256-gap \
    --traces-n 48 --out runs/s30/noise-b256
python -m studies.grpo_noise --recipe $R --traces runs/rb/traces --init scorers/smollm2-135m/sft-w256-gap \
    --traces-n 37 --set grpo.eta=0 --out runs/s30/noise-b256-eta0
# the tiny teacher (make demo's first two stages)
python -m foresight traces --recipe recipes/tiny-qwen3.yaml --out runs/tiny-qwen3/traces
python -m foresight sft --recipe recipes/tiny-qwen3.yaml --traces runs/tiny-qwen3/traces --out runs/tiny-qwen3/sft
python -m studies.grpo_noise --recipe recipes/tiny-qwen3.yaml --traces runs/tiny-qwen3/traces --init runs/tiny-qwen3/sft \
    --traces-n 128 --out runs/s30/noise-tiny
