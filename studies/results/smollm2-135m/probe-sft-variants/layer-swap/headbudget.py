"""Would a per-head budget help? The cache holds one budget for every head, so this *simulates* one (probe code, not
the engine's): the cache runs with room for the whole trace and never evicts by itself; before every chunk of L
tokens, each (layer, KV head) whose real pairs reached its own budget + L drops, by the policy's scores over its
candidates, down to its budget — the dropped slots are masked as padding (invisible to attention, never candidates)
instead of being removed. Same decisions as the engine's at a uniform budget up to the statistics' block bookkeeping;
the uniform rows check that against the engine's own (``swap.py``'s scorer row, ``heads.json``'s TOVA row).

    python studies/results/smollm2-135m/probe-sft-variants/layer-swap/headbudget.py SCORER_DIR OUT.json
"""

import json
import sys
from pathlib import Path
import time

import torch

from foresight.engine.cache import chunks as cache_chunks
from foresight.scorers.checkpoint import policy_from_checkpoint
from foresight.config.eviction import EvictionSettings
from foresight.engine.eviction import current_view
from foresight.policies import make_policy
from foresight.data.references import make_batch, trace_batches
from foresight.evaluation.report import bootstrap_ci
from foresight.engine.rollout import RolloutOptions, rollout
sys.path.insert(0, str(Path(__file__).resolve().parents[5]))  # the repository, for studies/
from studies.smollm2_probe import validation_probe  # noqa: E402

L = 32
BUDGETS = {"budgets": None}  # the rollout in progress: [nl, h] long per-head budgets
_plan = cache_chunks.plan


@torch.no_grad()
def enforce(cache) -> None:
    budgets = BUDGETS["budgets"]
    n = cache.n
    if budgets is None or n == 0 or cache.seen % L:
        return
    tok = cache.token[:, :, :, :n]
    real = (tok >= 0).sum(-1)  # [nl, b, h]
    bud = budgets.to(tok.device)[:, None, :]
    due = real >= bud + L
    if cache.seen >= int(budgets.min()):  # a new block of statistics every L tokens once evictions may start
        if due.any():
            view = current_view(cache)
            scores = cache.policy.score(view).float().masked_fill(~view.evictable, float("-inf"))
            drop = (real - bud).clamp(min=0) * due  # [nl, b, h]
            order = scores.argsort(-1, descending=True)  # the highest score is evicted first (as the engine's)
            rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n).expand_as(order))
            mask = (rank < drop[..., None]) & view.evictable
            cache.token[:, :, :, :n] = torch.where(mask, torch.full_like(tok, -1), tok)
            cache.padded = True
            cache.stats.end_block(n)
        cache.stats.reset_block(n)


def plan(cache, q, tok_out=None, valid_out=None):
    enforce(cache)
    return _plan(cache, q, tok_out, valid_out)


cache_chunks.plan = plan


def main(scorer_dir, out):
    probe = validation_probe(scorer_dir)
    model, tok, refs, bank, cfg = probe.model, probe.tok, probe.refs, probe.bank, probe.cfg
    nl, h = model.config.num_hidden_layers, model.config.num_key_value_heads
    longest = max(r["ids"].shape[1] for r in refs)
    room = EvictionSettings(budget=-(-longest // L) * L + L, interval=L)  # never evicts by itself

    def budgets(B, full=()):
        """B for every head; or the heads ``full`` (layer, head) a whole trace and the others one lower budget, so that
        the pairs held at the end of the longest trace average B over the heads (shorter traces: below B)."""
        b = torch.full((nl, h), B, dtype=torch.long)
        if full:
            for layer, head in full:
                b[layer, head] = room.budget
            rest = nl * h - len(full)
            b_rest = (nl * h * B - len(full) * longest) // rest
            for layer in range(nl):
                for head in range(h):
                    if (layer, head) not in full:
                        b[layer, head] = b_rest
        return b

    few = ((18, 2),)
    five = ((18, 2), (23, 0), (17, 1), (20, 2), (20, 1))
    B = 128
    variants = {"scorer, uniform": ("scorer", budgets(B)), "tova, uniform": ("tova", budgets(B)),
                "scorer, full 18/2": ("scorer", budgets(B, few)), "tova, full 18/2": ("tova", budgets(B, few)),
                "scorer, full five": ("scorer", budgets(B, five)), "tova, full five": ("tova", budgets(B, five))}
    sums = {}
    for members in trace_batches(refs, 48, False):
        batch = make_batch(refs, members, tok.pad_token_id)
        for name, (pol, bud) in variants.items():
            t0 = time.time()
            BUDGETS["budgets"] = bud
            policy = policy_from_checkpoint(bank, cfg) if pol == "scorer" else make_policy(pol)
            # no full=: with room for the whole trace it would take every position as pre-eviction
            res = rollout(model, batch["ids"], policy, room, prompt_len=batch["prompt_lens"][0],
                          attention_mask=batch["mask"], options=RolloutOptions(torch.Generator().manual_seed(0), entropy=False))
            for r, (S, p) in enumerate(zip(batch["lengths"], batch["prompt_lens"])):
                sums.setdefault(name, []).append((res.token_loss[r, p:S].sum().item(), batch["loss"][r, p:S].sum().item()))
            print(B, name, f"{time.time() - t0:.0f}s", flush=True)
    rows = {}
    for name, v in sums.items():
        ev, fu = [a for a, _ in v], [b for _, b in v]
        base = sums[name.split(",")[0] + ", uniform"]
        diff = [a - b for a, (b, _) in zip(ev, base)]
        rows[name] = {"loss_ratio": round(sum(ev) / sum(fu), 4), "ci": bootstrap_ci(ev, fu, 0),
                      "minus_uniform": round(sum(diff) / sum(fu), 4), "minus_uniform_ci": bootstrap_ci(diff, fu, 0),
                      "budgets_min_max": [int(variants[name][1].min()), int(variants[name][1].max())]}
        print(B, name, rows[name], flush=True)
    json.dump({"scorer": scorer_dir, "budget": B, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
