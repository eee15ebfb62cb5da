# docs/results/smollm2-135m/probe-sft-variants/heads/: the scorer input `heads` (each candidate's log-statistics averaged over every KV head of the layer that
# holds the same token) against the recipe's inputs, on the 264 realbench training traces (232 for SFT, the last 32
# for validation), width 256, gap-weighted pairs, 300 steps: the recipe's SFT, only scorer.features differs. Two SFT
# seeds of each (seed 1 keeps seed 0's stored golden steps: only the initialisation, batches and pairs move). 2-core Intel Xeon with AMX; the traces of
# ../../grpo-noise/run.sh (the same as ../example-steps/run.sh, whose recipe rows these reproduce to 4e-4).
export FORESIGHT_CACHE=runs/s34/cache R=recipes/smollm2-135m-realbench.yaml T=runs/rb/traces O=runs/s34
S="--recipe $R --traces $T --set sft.val_traces=32"
V="$S --set eval.num_problems=32 --set eval.recall=false --methods full --budgets 128:32,256:32"
python -m foresight sft $S --out $O/sft-base                                                  # ~12 min golden store + 683 s
python -m foresight sft $S --set sft.seed=1 --set sft.example_seed=0 --out $O/sft-base-s1     # 631 s
python -m foresight sft $S --set "scorer.features=[key,value,attn,heads]" --out $O/sft-heads  # 757 s
python -m foresight sft $S --set "scorer.features=[key,value,attn,heads]" --set sft.seed=1 --set sft.example_seed=0 \
    --out $O/sft-heads-s1
for X in base base-s1 heads heads-s1; do python -m foresight eval $V --scorers $O/sft-$X --out $O/val-$X; done  # ~2 min each
for B in base base-s1; do for X in heads heads-s1; do
  python -m foresight compare $O/val-$B $O/val-$X --base-method foresight-sft --method foresight-sft \
      --json $O/val-$X-minus-$B.json
done; done
python -m foresight compare $O/val-base $O/val-base-s1 --base-method foresight-sft --method foresight-sft \
    --json $O/val-base-s1-minus-base.json
