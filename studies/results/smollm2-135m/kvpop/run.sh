# docs/results/smollm2-135m/kvpop/: KVpop's MLP scorer on the realbench training traces (the last 32 for validation), with the realbench's
# KVpop settings, evaluated on the validation traces and the 384 held-out references of docs/results/smollm2-135m/heldout384/.
# 2-core AMD EPYC (AVX-512 BF16), commit 839bffc; FORESIGHT_CACHE holds the 384 references.
export FORESIGHT_CACHE=runs/probe/cache R=recipes/smollm2-135m-realbench.yaml RB=runs/rb O=runs/s29 A=runs/age
python -m foresight sft --recipe $R --traces $RB/traces --set sft.val_traces=32 --set sft.objective=kvpop --set kvpop.scorer=mlp \
    --set sft.lr=0.003 --set sft.warmup=10 --set sft.steps=60 --set sft.batch_traces=4 --out $O/kvpop-mlp
python -m foresight eval --recipe $R --traces $RB/traces --set sft.val_traces=32 --set eval.num_problems=32 --set eval.recall=false \
    --methods full --budgets 128:32,256:32 --scorers $O/kvpop-mlp --out $O/val-kvpop
python -m foresight eval --recipe $R --set eval.num_problems=384 --set traces.batch_size=96 --set eval.recall=false --methods full \
    --budgets 256:32 --scorers $O/kvpop-mlp --out $O/h384-b256-kvpop
# paired: the gap-weighted SFT scorer's rows (../probe-sft-variants/inputs-and-pairs/run.sh) and random-keep-prompt's (../heldout384/eval.sh)
python -m foresight compare $A/val-w256-gap-topk $O/val-kvpop --base-method foresight-sft --method kvpop-mlp
python -m foresight compare $A/h384-b256-gap $O/h384-b256-kvpop --base-method foresight-sft --method kvpop-mlp
python -m foresight compare runs/h384/eval $O/h384-b256-kvpop --base-method random-keep-prompt --method kvpop-mlp
# 300 steps instead of 60 (the realbench's KVPOP_SET since), the same evaluations
python -m foresight sft --recipe $R --traces $RB/traces --set sft.val_traces=32 --set sft.objective=kvpop --set kvpop.scorer=mlp \
    --set sft.lr=0.003 --set sft.warmup=10 --set sft.steps=300 --set sft.batch_traces=4 --set sft.ckpt_every=25 --out $O/kvpop-mlp-300
python -m foresight eval --recipe $R --traces $RB/traces --set sft.val_traces=32 --set eval.num_problems=32 --set eval.recall=false \
    --methods full --budgets 128:32,256:32 --scorers $O/kvpop-mlp-300 --out $O/val-kvpop-300
python -m foresight eval --recipe $R --set eval.num_problems=384 --set traces.batch_size=96 --set eval.recall=false --methods full \
    --budgets 256:32 --scorers $O/kvpop-mlp-300 --out $O/h384-b256-kvpop300
python -m foresight compare $O/val-kvpop $O/val-kvpop-300 --base-method kvpop-mlp --method kvpop-mlp
