"""Would per-*layer* budgets help beyond the whole head? The head search (heads.json) found layers 0-14 and 25-29
nearly free to evict (all their heads whole save <= 0.011) and 15-24 where the loss is. This simulates moving memory
from the former to the latter (the layer-swap probe's masking simulation,
../probe-sft-variants/layer-swap/headbudget.py, imported: per-(layer, KV head) budgets enforced before every L-token
chunk; slots masked, not freed), the total held at the end of the longest validation trace kept at 90 x 128 pairs, on
the 32 validation traces with the scorer of ../probe-sft-variants/heads/run.sh (runs/s34/sft-base).

    python studies/results/smollm2-135m/whole-heads/layerbudget.py runs/s34/sft-base OUT.json
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location(
    "headbudget", Path(__file__).parents[1] / "probe-sft-variants" / "layer-swap" / "headbudget.py")
hb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hb)  # patches cache_chunks.plan with the per-head budget enforcement

from foresight.scorers.checkpoint import policy_from_checkpoint  # noqa: E402
from foresight.config.eviction import EvictionSettings  # noqa: E402
from foresight.evaluation.paired import paired_diff_ci  # noqa: E402
from foresight.policies import make_policy  # noqa: E402
from foresight.data.references import make_batch, trace_batches  # noqa: E402
from foresight.evaluation.report import bootstrap_ci  # noqa: E402
from foresight.engine.rollout import RolloutOptions, rollout  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository, for studies/
from studies.smollm2_probe import validation_probe  # noqa: E402

MID = range(15, 25)


def main(scorer_dir, out):
    probe = validation_probe(scorer_dir)
    model, tok, refs, bank, cfg = probe.model, probe.tok, probe.refs, probe.bank, probe.cfg
    nl, h = model.config.num_hidden_layers, model.config.num_key_value_heads
    longest = max(r["ids"].shape[1] for r in refs)
    L = hb.L
    room = EvictionSettings(budget=-(-longest // L) * L + L, interval=L)

    def budgets(mid: int, rest: int, whole=()):
        b = torch.full((nl, h), rest, dtype=torch.long)
        b[list(MID)] = mid
        for layer, head in whole:
            b[layer, head] = room.budget
        return b

    def total(b):
        return int(torch.clamp(b, max=longest).sum())

    variants = {"scorer, uniform 128": ("scorer", budgets(128, 128)),
                "scorer, 15-24 at 192, rest 96": ("scorer", budgets(192, 96)),
                "scorer, 15-24 at 224, rest 80": ("scorer", budgets(224, 80)),
                "scorer, 18:2 whole, 15-24 at 175, rest 87": ("scorer", budgets(175, 87, ((18, 2),))),
                "tova, uniform 128": ("tova", budgets(128, 128)),
                "tova, 15-24 at 192, rest 96": ("tova", budgets(192, 96))}
    sums = {}
    for members in trace_batches(refs, 48, False):
        batch = make_batch(refs, members, tok.pad_token_id)
        for name, (pol, bud) in variants.items():
            t0 = time.time()
            hb.BUDGETS["budgets"] = bud
            policy = policy_from_checkpoint(bank, cfg) if pol == "scorer" else make_policy(pol)
            res = rollout(model, batch["ids"], policy, room, prompt_len=batch["prompt_lens"][0],
                          attention_mask=batch["mask"],
                          options=RolloutOptions(torch.Generator().manual_seed(0), entropy=False))
            for r, (S, p) in enumerate(zip(batch["lengths"], batch["prompt_lens"])):
                sums.setdefault(name, []).append((res.token_loss[r, p:S].sum().item(), batch["loss"][r, p:S].sum().item()))
            print(name, f"{time.time() - t0:.0f}s", flush=True)
    rows = {}
    for name, v in sums.items():
        ev, fu = [a for a, _ in v], [b for _, b in v]
        base = sums[name.split(",")[0] + ", uniform 128"]
        rows[name] = {"loss_ratio": round(sum(ev) / sum(fu), 4), "ci": bootstrap_ci(ev, fu, 0),
                      "minus_uniform": round(sum(ev) / sum(fu) - sum(a for a, _ in base) / sum(b for _, b in base), 4),
                      "minus_uniform_ci": paired_diff_ci([a for a, _ in base], [b for _, b in base], ev, fu),
                      "pairs_at_longest": total(variants[name][1]), "uniform_pairs": nl * h * 128}
        print(name, rows[name], flush=True)
    json.dump({"scorer": scorer_dir, "longest": longest, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
