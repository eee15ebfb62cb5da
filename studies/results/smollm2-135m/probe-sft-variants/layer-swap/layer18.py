"""Layer 18 of SmolLM2 holds the largest single share of the SFT scorer's loss gap to golden (`swap.py`). Which KV head,
and is it the prompt? Along the scorer's rollout at B=128: golden's decisions in one KV head of layer 18 only; and the
scorer with the prompt's pairs ranked last for eviction (kept while any other candidate is left) in layer 18, in layers
15-24 and in every layer.

    python studies/results/smollm2-135m/probe-sft-variants/layer-swap/layer18.py SCORER_DIR OUT.json
    python studies/results/smollm2-135m/probe-sft-variants/layer-swap/layer18.py SCORER_DIR OUT.json heads

``heads``: instead, golden in each KV head of layers 17, 20 and 23 alone, and TOVA with and without golden in layer
18's KV head 2.
"""

import json
import sys
from pathlib import Path
import time

import torch

from foresight.scorers.checkpoint import policy_from_checkpoint
from foresight.config.eviction import EvictionSettings
from foresight.targets.golden import GoldenPolicy
from foresight.policies import make_policy
from foresight.policies.base import Policy
from foresight.evaluation.report import bootstrap_ci
from foresight.engine.rollout import RolloutOptions, rollout
sys.path.insert(0, str(Path(__file__).resolve().parents[5]))  # the repository, for studies/
from studies.smollm2_probe import golden_batches, validation_probe  # noqa: E402


class Masked(Policy):
    """``first``'s ranking where ``mask`` [nl, h] is set, ``second``'s elsewhere."""

    def __init__(self, first, second, mask):
        self.first, self.second, self.mask = first, second, mask
        self.reads = frozenset(first.reads or ()) | frozenset(second.reads or ())

    def score(self, view):
        a, b = self.first.score(view).float(), self.second.score(view).float()
        return torch.where(self.mask[:, None, :, None], a, b)


class PromptLast(Policy):
    """``inner``'s ranking with the prompt's pairs evicted only when nothing else is left."""

    def __init__(self, inner, prompt_lens):
        self.inner, self.reads = inner, inner.reads
        self.plen = torch.tensor(prompt_lens)[None, :, None, None]  # each row's own prompt

    def score(self, view):
        s = self.inner.score(view).float()
        s = (s - s.amin(-1, keepdim=True)) / (s.amax(-1, keepdim=True) - s.amin(-1, keepdim=True)).clamp(min=1e-9)
        return s + ((view.token >= 0) & (view.token < self.plen)).float() * 2.0


def main(scorer_dir, out, what="layer18"):
    probe = validation_probe(scorer_dir)
    model, bank, cfg = probe.model, probe.bank, probe.cfg
    nl, h = model.config.num_hidden_layers, model.config.num_key_value_heads

    def mask(layers, heads=None):
        m = torch.zeros(nl, h, dtype=torch.bool)
        for layer in layers:
            m[layer, heads if heads is not None else slice(None)] = True
        return m

    B = 128
    st = EvictionSettings(budget=B, interval=32)
    sums = {}
    for batch, fut in golden_batches(probe, st):
        lengths = batch["lengths"]

        def scorer():
            return policy_from_checkpoint(bank, cfg)

        variants = {"scorer": scorer}
        if what == "heads":
            for layer in (17, 20, 23):
                for head in range(h):
                    variants[f"golden-in-{layer}-head{head}"] = lambda layer=layer, head=head: Masked(
                        GoldenPolicy(fut), scorer(), mask([layer], head))
            variants["tova"] = lambda: make_policy("tova")
            variants["tova, golden-in-18-head2"] = lambda: Masked(GoldenPolicy(fut), make_policy("tova"), mask([18], 2))
        else:
            for head in range(h):
                variants[f"golden-in-18-head{head}"] = lambda head=head: Masked(GoldenPolicy(fut), scorer(),
                                                                                mask([18], head))
            plens = batch["prompt_lens"]
            variants["prompt-last-in-18"] = lambda: Masked(PromptLast(scorer(), plens), scorer(), mask([18]))
            variants["prompt-last-in-15-24"] = lambda: Masked(PromptLast(scorer(), plens), scorer(), mask(range(15, 25)))
            variants["prompt-last-everywhere"] = lambda: PromptLast(scorer(), plens)
        for name, make in variants.items():
            t0 = time.time()
            res = rollout(model, batch["ids"], make(), st, prompt_len=batch["prompt_lens"][0],
                          attention_mask=batch["mask"],
                          options=RolloutOptions(torch.Generator().manual_seed(0), full=(batch["loss"], batch["entropy"]),
                                                 entropy=False))
            for r, (S, p) in enumerate(zip(lengths, batch["prompt_lens"])):
                sums.setdefault(name, []).append((res.token_loss[r, p:S].sum().item(), batch["loss"][r, p:S].sum().item()))
            print(B, name, f"{time.time() - t0:.0f}s", flush=True)
    rows, base = {}, sums["scorer"]
    for name, v in sums.items():
        ev, fu = [a for a, _ in v], [b for _, b in v]
        diff = [a - b for a, (b, _) in zip(ev, base)]
        rows[name] = {"loss_ratio": round(sum(ev) / sum(fu), 4), "ci": bootstrap_ci(ev, fu, 0),
                      "minus_scorer": round(sum(diff) / sum(fu), 4), "minus_scorer_ci": bootstrap_ci(diff, fu, 0)}
        print(B, name, rows[name], flush=True)
    json.dump({"scorer": scorer_dir, "budget": B, "what": what, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
