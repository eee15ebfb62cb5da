# docs/results/smollm2-135m/probe-sft-variants/ahead/: the scorer input `ahead` (the last 32 queries' attention as if 16/32/64/128 tokens later) against the
# recipe's inputs, on the 264 realbench training traces (232 for SFT, the last 32 for validation), width 256,
# gap-weighted pairs, 300 steps: the recipe's SFT, only scorer.features differs. Two SFT seeds (seed 1 keeps seed 0's
# stored golden steps). The recipe's own two seeds are those of ../heads/run.sh (runs/s34/sft-base, -s1 and their
# val-* evaluations). 2-core Intel Xeon with AMX, commit 2281ff7 (run from a worktree of it); the traces of
# ../../grpo-noise/run.sh (runs/rb/traces).
export FORESIGHT_CACHE=runs/s35/cache R=recipes/smollm2-135m-realbench.yaml T=runs/rb/traces O=runs/s35 P=runs/s34
D=docs/results/smollm2-135m/probe-sft-variants/ahead  # the data
H=studies/results/smollm2-135m/probe-sft-variants/ahead  # this script's folder
python $H/screen.py && python $H/screen_analyse.py > $D/screen.txt   # the full-cache screen (~2 min)
S="--recipe $R --traces $T --set sft.val_traces=32"
V="$S --set eval.num_problems=32 --set eval.recall=false --methods full --budgets 128:32,256:32"
F='scorer.features=[key,value,attn,ahead]'
python -m foresight sft $S --set "$F" --out $O/sft-ahead        # golden store (layout 3) 11.4 min + 684 s
python -m foresight sft $S --set "$F" --set sft.seed=1 --set sft.example_seed=0 --out $O/sft-ahead-s1   # 743 s
for X in ahead ahead-s1; do
  python -m foresight eval $V --scorers $O/sft-$X --out $O/val-$X                                       # ~2 min
  for B in base base-s1; do
    python -m foresight compare $P/val-$B $O/val-$X --base-method foresight-sft --method foresight-sft \
        --json $O/val-$X-minus-$B.json
  done
done
python $H/seed_mean.py $P/val-base $P/val-base-s1 $O/val-ahead $O/val-ahead-s1 > $D/seed_mean.txt
# held-out test: the 48 references of docs/results/smollm2-135m/all-methods/ (FORESIGHT_CACHE=runs/s32/cache holds them), seed 0's scorer
# against the recommended scorers/smollm2-135m/sft-w256-gap rows there
export FORESIGHT_CACHE=runs/s32/cache A=docs/results/smollm2-135m/all-methods
python -m foresight eval --recipe $R --methods full --budgets 128:32,256:32 --scorers $O/sft-ahead --out $O/test-ahead
python -m foresight compare $A $O/test-ahead --base-method foresight-sft --method foresight-sft --json $D/test-minus-w256gap.json
python -m foresight eval --recipe $R --methods full --budgets 512:32 --set eval.recall=false --scorers $O/sft-ahead \
    --out $O/test-ahead-512
python -m foresight compare $A $O/test-ahead-512 --base-method foresight-sft --method foresight-sft \
    --json $D/test-512-minus-w256gap.json
# the heuristic `lookahead` (evict the lowest a32, group mean) on the same 48 references, against the heuristics of
# docs/results/smollm2-135m/all-methods/ (commit 324bc9b)
python -m foresight eval --recipe $R --methods full,lookahead --budgets 128:32,256:32,512:32 --set eval.recall=false \
    --out $O/test-lookahead
for M in snapkv tova scissorhands streamingllm random-keep-prompt; do
  python -m foresight compare $A $O/test-lookahead --base-method $M --method lookahead --json $D/lookahead-minus-$M.json
done
python -m foresight compare $O/test-lookahead $A --base-method lookahead --method foresight-sft --json $D/sft-minus-lookahead.json
