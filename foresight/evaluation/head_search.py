"""Which KV heads to keep whole (``cache.whole_heads``) for a model and an eviction method: ``foresight heads``.

A method's eviction loss is not spread evenly over the heads (on SmolLM2-135M one KV head of 90 holds 43% of the gap
between the learned scorer and golden at B=128). This search measures it with the method itself, on a traces folder's
validation traces (never the held-out references): the loss ratio when a set of KV heads is kept whole
(:mod:`foresight.engine.cache.whole_heads`) against the same method with none, paired over the traces. Coarse to fine, so that a
30-layer model costs ~25 rollouts rather than one per head:

1. every group of ``group`` consecutive layers whole (all their KV heads);
2. each layer of the ``top_groups`` groups that saved most, alone;
3. each KV head of the ``top_layers`` layers that saved most, alone.

The heads whose saving's paired 95% interval lies above zero (at most ``max_heads``, best first) are then measured as
the allocation they ask for: the first k of them whole at the budget that holds the memory of the uniform budget on
the longest trace (:func:`equal_memory_budget`), k = 1, 2, ...; the set with the largest saving at equal memory whose
interval lies above zero is recommended (none: no whole head pays for the pairs it takes from the others).

The same groups' savings also say where per-layer budgets (:mod:`foresight.engine.cache.layer_budgets`) should move memory: the
``top_groups`` groups get ``w`` times the other layers' share (``shares``, e.g. 1.5, 2, 3; the mean budget stays B,
so the memory is the uniform budget's), and the best separated share is measured once more with the recommended whole
heads at their budget. The recommendation is the allocation with the largest separated saving of the three kinds.
Every unit is written to ``OUT/heads.json`` when it finishes; a killed search resumes from them.

    foresight heads --recipe recipes/smollm2-135m-realbench.yaml --traces runs/rb/traces \\
        --scorers scorers/smollm2-135m/sft-w256-gap --budgets 128:32 --out runs/heads
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from foresight.engine.cache import layer_budgets

from foresight.runtime import atomic
from foresight.scorers.checkpoint import read_config
from foresight.runtime.locks import locks_output
from foresight.evaluation.methods import build_methods, check_names
from foresight.engine.models import load_model
from foresight.data.references import make_batch, trace_batches
from foresight.evaluation.report import paired_ratio_diff_ci
from foresight.engine.rollout import RolloutOptions, rollout
from foresight.evaluation.validation_references import validation_references
from foresight.config.checks import parse_budgets


@dataclasses.dataclass(frozen=True)
class HeadSearch:
    """The search's shape: layers per group, how many groups and layers are refined, how many heads recommended, and
    the shares of the budget tried for the best groups' layers (per-layer budgets)."""

    group: int = 5
    top_groups: int = 2
    top_layers: int = 3
    max_heads: int = 3
    shares: tuple[float, ...] = (1.5, 2.0, 3.0)

    def validate(self) -> None:
        for name in ("group", "top_groups", "top_layers", "max_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"heads: {name} must be > 0, got {getattr(self, name)}")
        if any(not w > 1 for w in self.shares):
            raise ValueError(f"heads: every share must be > 1 (the best groups' weight against the others' 1), got "
                             f"{list(self.shares)}")


def equal_memory_budget(budget: int, interval: int, heads: int, total_heads: int, longest: int) -> int:
    """The budget at which ``heads`` whole KV heads (of ``total_heads``) plus the bounded ones hold no more pairs at the
    end of a ``longest``-token trace than every head at ``budget`` (the whole heads' slots count too)."""
    return budget - math.ceil(heads * longest / total_heads)


def _unit_name(heads: list[tuple[int, int]]) -> str:
    return ",".join(f"{layer}:{h}" for layer, h in heads)


class _Runner:
    """Rollouts of one method on the validation traces, a set of whole heads at a time: per-trace loss sums."""

    def __init__(self, model, refs, method, settings, pad_id: int, batch_size: int):
        self.model, self.method, self.settings = model, method, settings
        self.batches = [make_batch(refs, m, pad_id) for m in trace_batches(refs, batch_size, False)]

    def sums(self, heads: list[tuple[int, int]], budget: int | None = None, shares: list[str] = ()) -> dict:
        st = self.settings.replace(whole_heads=[f"{layer}:{h}" for layer, h in heads],
                                   budget=budget or self.settings.budget, layer_budgets=list(shares))
        evicted, full, traces = [], [], []
        for batch in self.batches:
            res = rollout(self.model, batch["ids"], self.method.make_policy(), st, prompt_len=batch["prompt_lens"][0],
                          attention_mask=batch["mask"],
                          options=RolloutOptions(torch.Generator().manual_seed(0), full=(batch["loss"], batch["entropy"]),
                                                 entropy=False))
            for r, (S, p) in enumerate(zip(batch["lengths"], batch["prompt_lens"])):
                evicted.append(round(res.token_loss[r, p:S].sum().item(), 5))
                full.append(round(batch["loss"][r, p:S].sum().item(), 5))
                traces.append(batch["members"][r])
        order = sorted(range(len(traces)), key=traces.__getitem__)
        return {"evicted": [evicted[i] for i in order], "full": [full[i] for i in order]}


def _ratio(sums: dict) -> float:
    """A unit's loss ratio: its evicted loss over the full cache's, summed over the traces."""
    return sum(sums["evicted"]) / sum(sums["full"])


def _saving(base: dict, unit: dict, seed: int) -> dict:
    """A unit's loss ratio and its saving against the uniform ``base`` (base − unit, paired over the same traces)."""
    ratio, base_ratio = _ratio(unit), _ratio(base)
    ci = paired_ratio_diff_ci(*({"evicted_loss": r["evicted"], "full_loss": r["full"]} for r in (base, unit)), seed)
    return {"loss_ratio": round(ratio, 5), "saving": round(base_ratio - ratio, 5), "saving_ci": ci}


def _separated(row: dict) -> bool:
    """The saving's paired 95% interval lies above zero."""
    return bool(row["saving_ci"]) and row["saving_ci"][0] > 0


@locks_output("heads")
def search_heads(recipe, traces_dir, out, method: str | None = None, scorers=(), budget: str = "128:32",
                 search: HeadSearch = HeadSearch(), log=print) -> dict:
    """Search the KV heads to keep whole for ``method`` (a heuristic's name) or the scorer checkpoint ``scorers[0]``
    at ``budget`` (``B:L``) on the validation traces of ``traces_dir``; writes and returns ``OUT/heads.json``."""
    search.validate()
    if bool(method) == bool(scorers):
        raise ValueError("heads: give one method (--method NAME) or one scorer checkpoint (--scorers DIR)")
    budgets = parse_budgets(budget)
    if len(budgets) != 1:
        raise ValueError(f"heads: one budget B:L, got {budget!r}")
    (B, L), = budgets
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(recipe.model)
    device = next(model.parameters()).device
    _, refs = validation_references(recipe, traces_dir, model, device, list(scorers), log=log)
    names = check_names([method]) if method else []
    meth = build_methods(names, list(scorers), model, recipe.eval.protect_prompt)[-1]
    if meth.is_full or meth.teacher_forced_only:
        raise ValueError(f"heads: {meth.name} does not evict by its own scores; choose a heuristic or a scorer")
    settings = meth.settings(B, L, recipe.cache.prompt_overflow)
    settings.validate()
    cfg = model.config
    nl, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    # what a unit's losses depend on (not the search's shape: a rerun with other top_layers or max_heads reuses them)
    identity = {"method": meth.name, "scorer": [[str(d), read_config(d).get("created")] for d in scorers],
                "traces": str(traces_dir), "validation": len(refs), "budget": [B, L], "model": recipe.model.path,
                "dtype": recipe.model.dtype}
    identity = json.loads(json.dumps(identity))  # as it reads back from heads.json
    path = out / "heads.json"
    saved = json.loads(path.read_text()) if path.exists() else None  # written atomically: whole or absent
    result = saved if saved and saved.get("identity") == identity else {"identity": identity, "units": {}}
    runner = _Runner(model, refs, meth, settings, tok.pad_token_id, recipe.eval.batch_size)

    def measure(heads: list[tuple[int, int]], level: str, at: int = B, shares: list[str] = ()) -> dict:
        name = (_unit_name(heads) or ("none" if not shares else "")) + ("" if at == B else f"@B={at}")
        name += f" layers {','.join(shares)}" if shares else ""
        if name not in result["units"]:
            t0 = time.time()
            sums = runner.sums(heads, at, shares)
            row = {"level": level, "heads": [list(h) for h in heads], "budget": at, "layer_budgets": list(shares), **sums}
            if heads or shares:
                row.update(_saving(result["units"]["none"], sums, recipe.eval.seed))
            else:  # the uniform budget's own loss ratio, the base every saving is taken from
                row["loss_ratio"] = round(_ratio(sums), 5)
            result["units"][name] = row
            atomic.write_json(path, result, indent=1)
            log(f"[heads] {level} {name}: loss ratio {row['loss_ratio']:.4f}, saving {row.get('saving', 0):+.4f} "
                f"{row.get('saving_ci')} ({time.time() - t0:.0f} s)")
        return result["units"][name]

    def every_head(layers):
        return [(layer, h) for layer in layers for h in range(kv)]

    measure([], "none")
    groups = [list(range(i, min(i + search.group, nl))) for i in range(0, nl, search.group)]
    by_group = sorted(groups, key=lambda g: -measure(every_head(g), "group")["saving"])
    layers = [layer for g in by_group[:search.top_groups] for layer in g]
    by_layer = sorted(layers, key=lambda layer: -measure(every_head([layer]), "layer")["saving"])
    heads = [(layer, h) for layer in by_layer[:search.top_layers] for h in range(kv)]
    ranked = sorted(heads, key=lambda hd: -measure([hd], "head")["saving"])
    helpful = [hd for hd in ranked if _separated(measure([hd], "head"))][:search.max_heads]
    longest = max(int(r["ids"].shape[1]) for r in refs)
    result["ranked_heads"] = [{"head": _unit_name([hd]), **{k: measure([hd], "head")[k] for k in
                                                             ("loss_ratio", "saving", "saving_ci")}} for hd in ranked]
    # each prefix of the helpful heads at the budget that pays for them: a whole head is worth it only when it saves
    # more than the other heads lose to the smaller budget
    options = []
    for k in range(1, len(helpful) + 1):
        at = equal_memory_budget(B, L, k, nl * kv, longest)
        if at <= L or at < settings.sinks + (settings.window or L):
            break
        options.append((helpful[:k], at, measure(helpful[:k], "equal memory", at)))
    paying = [o for o in options if _separated(o[2])]
    best = max(paying, key=lambda o: o[2]["saving"], default=None)
    result["equal_memory"] = [{"whole_heads": [_unit_name([hd]) for hd in hs], "budget": at,
                               **{k: row[k] for k in ("loss_ratio", "saving", "saving_ci")}} for hs, at, row in options]
    # per-layer budgets: the best groups' layers at w times the others' share, the mean budget (the memory) unchanged
    candidates = [(hs, at, row, []) for hs, at, row in paying]
    top = by_group[:search.top_groups]
    for w in search.shares if sum(len(g) for g in top) < nl else ():  # the best groups hold every layer: nothing moves
        shares = [f"{g[0]}{f'-{g[-1]}' if len(g) > 1 else ''}:{w:g}" for g in top]
        try:
            layer_budgets.check(layer_budgets.budgets(shares, B, nl), L, settings.window or L, settings.sinks)
        except ValueError:
            break  # the other layers' share leaves no room for an eviction: larger shares would not either
        row = measure([], "layer shares", B, shares)
        result.setdefault("layer_shares", {})[",".join(shares)] = {k: row[k] for k in ("loss_ratio", "saving", "saving_ci")}
        if _separated(row):
            candidates.append(([], B, row, shares))
    best_shares = max((c for c in candidates if c[3]), key=lambda c: c[2]["saving"], default=None)
    if best and best_shares:  # both kinds: the whole heads at their budget, the shares on top
        row = measure(best[0], "heads and shares", best[1], best_shares[3])
        if _separated(row):
            candidates.append((best[0], best[1], row, best_shares[3]))
    choice = max(candidates, key=lambda c: c[2]["saving"], default=None)
    result["recommended"] = {"whole_heads": [_unit_name([hd]) for hd in choice[0]] if choice else [],
                             "layer_budgets": choice[3] if choice else [],
                             "budget": choice[1] if choice else B, "saving": choice[2]["saving"] if choice else 0.0,
                             "saving_ci": choice[2]["saving_ci"] if choice else None, "longest_trace": longest}
    result["search"] = dataclasses.asdict(search) | {"shares": list(search.shares)}  # as it reads back
    atomic.write_json(path, result, indent=1)
    rec = result["recommended"]
    if choice:
        sets = " ".join(f"--set cache.{k}={','.join(rec[k])}" for k in ("whole_heads", "layer_budgets") if rec[k])
        log(f"[heads] recommended: {sets} at B={rec['budget']} (the memory of B={B} on a {longest}-token trace) lowers "
            f"the loss ratio by {rec['saving']:.4f} {rec['saving_ci']} on the validation traces")
    else:
        log(f"[heads] neither a whole head nor a layer share pays for its memory at B={B}: keep the uniform budget")
    return result
