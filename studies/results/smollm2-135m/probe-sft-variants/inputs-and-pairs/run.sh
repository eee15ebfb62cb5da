# docs/results/smollm2-135m/probe-sft-variants/inputs-and-pairs/: the pair's age as a scorer input, and gap-weighted hinge pairs, each against the width-256 SFT of
# docs/results/smollm2-135m/sft-w256/ (same 264 traces of `foresight traces --set traces.batch_size=64`, the last 32 for validation).
# 2-core AMD EPYC (AVX-512 BF16), code of commit c4fc1df; FORESIGHT_CACHE holds the 384 held-out references of
# docs/results/smollm2-135m/heldout384/ and the golden examples.
export FORESIGHT_CACHE=runs/probe/cache R=recipes/smollm2-135m-realbench.yaml RB=runs/rb A=runs/age
S="--recipe $R --traces $RB/traces --set sft.val_traces=32 --set scorer.hidden=256"
python -m foresight sft $S --set sft.pair_weight=uniform --out $RB/sft-w256            # the base (docs/results/smollm2-135m/sft-w256/)
python -m foresight sft $S --set sft.pair_weight=uniform --set "scorer.features=[key,value,attn,age]" --out $A/sft-w256-age
python -m foresight sft $S --set sft.pair_weight=gap --out $A/sft-w256-gap
V="--recipe $R --traces $RB/traces --set sft.val_traces=32 --set eval.num_problems=32 --set eval.recall=false --methods full --budgets 128:32,256:32"
for s in sft-w256-age sft-w256-gap; do python -m foresight eval $V --scorers $A/$s --out $A/val-$s-topk; done
python -m foresight compare $RB/val-w256-topk $A/val-sft-w256-gap-topk      # and -age
T="--recipe $R --set eval.num_problems=384 --set traces.batch_size=96 --set eval.recall=false --methods full"
python -m foresight eval $T --budgets 128:32 --scorers scorers/smollm2-135m/sft-w256 --scorers $A/sft-w256-gap --out $A/h384-b128
python -m foresight eval $T --budgets 256:32 --scorers $A/sft-w256-gap --out $A/h384-b256-gap
python -m foresight compare $A/h384-b128 $A/h384-b128 --base-method foresight-sft --method 'foresight-sft(sft-w256-gap)'
python -m foresight compare runs/h384/eval $A/h384-b256-gap --base-method foresight-sft --method foresight-sft  # heldout384's row
