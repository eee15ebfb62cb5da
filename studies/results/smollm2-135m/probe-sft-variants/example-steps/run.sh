# docs/results/smollm2-135m/probe-sft-variants/example-steps/: golden states per trace (sft.example_steps 4 -> 12) on the 264 realbench training traces (232 for SFT, the
# last 32 for validation), width 256, gap-weighted pairs, 300 steps, SFT seed 0: the recipe's SFT, only the stored steps
# differ. 2-core Intel Xeon with AMX; traces regenerated on it by ../../grpo-noise/run.sh
# (`foresight traces`, the realbench recipe).
export FORESIGHT_CACHE=runs/s31/cache R=recipes/smollm2-135m-realbench.yaml T=runs/rb/traces O=runs/s31
S="--recipe $R --traces $T --set sft.val_traces=32"
python -m foresight sft $S --out $O/sft-s4                               # 25 min golden store + 1,052 s SFT
python -m foresight sft $S --set sft.example_steps=12 --out $O/sft-s12   # 10 min golden store + ~2,800 s SFT
V="--recipe $R --traces $T --set sft.val_traces=32 --set eval.num_problems=32 --set eval.recall=false --methods full --budgets 128:32,256:32"
python -m foresight eval $V --scorers $O/sft-s4 --scorers $O/sft-s12 --out $O/val-s4-s12
python -m foresight compare $O/val-s4-s12 $O/val-s4-s12 --base-method 'foresight-sft' --method 'foresight-sft(sft-s12)'
python -m foresight sft $S --set sft.seed=1 --set sft.example_seed=0 --out $O/sft-s4-seed1  # the seed control, same stored steps
python -m foresight eval $V --scorers $O/sft-s4-seed1 --out $O/val-s4-seed1
python -m foresight compare $O/val-s4-s12 $O/val-s4-seed1 --base-method foresight-sft --method foresight-sft
