"""Where does the SFT scorer lose its loss? Along the scorer's own rollout, golden's decisions replace the scorer's in
one group of layers at a time (the other layers keep the scorer's), and the loss ratio of that hybrid is measured on
the 32 validation traces: how much of the gap scorer − golden each group's errors cost.

    python studies/results/smollm2-135m/probe-sft-variants/layer-swap/swap.py SCORER_DIR OUT.json [GROUP_SIZE] [BUDGETS]

GROUP_SIZE ``5``: consecutive groups of 5 layers, golden in one group (and, as the complement, the scorer in one
group with golden elsewhere); ``15-24``: each single layer of 15..24, golden in it only. BUDGETS: e.g. ``128,256``.
"""

import json
import sys
from pathlib import Path
import time

import torch

from foresight.scorers.checkpoint import policy_from_checkpoint
from foresight.config.eviction import EvictionSettings
from foresight.targets.golden import GoldenPolicy
from foresight.policies.base import Policy
from foresight.evaluation.report import bootstrap_ci
from foresight.engine.rollout import RolloutOptions, rollout
sys.path.insert(0, str(Path(__file__).resolve().parents[5]))  # the repository, for studies/
from studies.smollm2_probe import golden_batches, validation_probe  # noqa: E402


class Hybrid(Policy):
    """Golden's ranking in the layers ``layers``, the scorer's elsewhere (ranks per (layer, row, head): mixing per layer
    is exact)."""

    def __init__(self, golden, learned, layers, num_layers):
        self.golden, self.learned = golden, learned
        self.mask = torch.zeros(num_layers, dtype=torch.bool)
        self.mask[list(layers)] = True
        self.reads = frozenset(golden.reads or ()) | frozenset(learned.reads or ())

    def score(self, view):
        s = self.learned.score(view).float()
        g = self.golden.score(view).float()
        return torch.where(self.mask.to(s.device)[:, None, None, None], g, s)


def main(scorer_dir, out, group="5", budgets="128,256"):
    probe = validation_probe(scorer_dir)
    model, bank, cfg = probe.model, probe.bank, probe.cfg
    nl = model.config.num_hidden_layers
    if "-" in group:  # single layers, golden in each alone
        lo, hi = map(int, group.split("-"))
        groups, complement = [[i] for i in range(lo, hi + 1)], False
    else:
        size = int(group)
        groups, complement = [list(range(i, min(i + size, nl))) for i in range(0, nl, size)], True
    result = {"scorer": scorer_dir, "groups": groups, "rows": {}}
    for B in map(int, budgets.split(",")):
        st = EvictionSettings(budget=B, interval=32)
        sums = {}
        for batch, fut in golden_batches(probe, st):
            lengths = batch["lengths"]
            variants = {"scorer": lambda: policy_from_checkpoint(bank, cfg), "golden": lambda: GoldenPolicy(fut)}
            for g in groups:
                variants[f"golden-in-{g[0]}-{g[-1]}"] = lambda g=g: Hybrid(GoldenPolicy(fut),
                                                                           policy_from_checkpoint(bank, cfg), g, nl)
                if complement:
                    variants[f"scorer-in-{g[0]}-{g[-1]}"] = lambda g=g: Hybrid(policy_from_checkpoint(bank, cfg),
                                                                               GoldenPolicy(fut), g, nl)
            for name, make in variants.items():
                t0 = time.time()
                gen = torch.Generator().manual_seed(0)
                res = rollout(model, batch["ids"], make(), st, prompt_len=batch["prompt_lens"][0],
                              attention_mask=batch["mask"],
                              options=RolloutOptions(gen, full=(batch["loss"], batch["entropy"]), entropy=False))
                for r, (S, p) in enumerate(zip(lengths, batch["prompt_lens"])):
                    sums.setdefault(name, []).append((res.token_loss[r, p:S].sum().item(), batch["loss"][r, p:S].sum().item()))
                print(B, name, f"{time.time() - t0:.0f}s", flush=True)
        rows = {}
        base = sums["scorer"]
        for name, v in sums.items():
            ev, fu = [a for a, _ in v], [b for _, b in v]
            ratio = sum(ev) / sum(fu)
            # paired: (this − scorer) loss ratio, bootstrap over traces
            diff = [a - b for a, (b, _) in zip(ev, base)]
            rows[name] = {"loss_ratio": round(ratio, 4), "ci": bootstrap_ci(ev, fu, 0),
                          "minus_scorer": round(sum(diff) / sum(fu), 4), "minus_scorer_ci": bootstrap_ci(diff, fu, 0)}
            print(B, name, rows[name], flush=True)
        result["rows"][str(B)] = rows
        json.dump(result, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
