"""How much of golden's eviction the past decides: an estimate of the best recall@L that any scorer can reach.

Golden eviction reads the future: at each step it drops the L candidates that the rest of *this* trace attends to
least. A scorer sees only the past, so the best it can do is to drop what golden drops on average over the futures
the model could write from here. This measures that limit on held-out references. At an eviction point along
golden's trajectory of a reference, the model writes ``K`` more continuations of the same prefix, sampled with the
recipe's settings (the reference is one such sample: the reference and the continuations are exchangeable), and
golden's choice under each continuation's future is compared with golden's choice under the reference's own:

* ``agreement``: |golden(reference) ∩ golden(continuation)| / L, averaged over the continuations: how far a second
  future's golden agrees with the first.
* ``ceiling``: a predictor that knows the distribution of futures (estimated from the K continuations) drops the L
  candidates that golden drops most often across them (ties: the lowest mean future score); its recall@L against the
  reference's golden. With K continuations it is an estimate of the Bayes limit of any past-only scorer at this state
  that rises with K (``ceiling_half`` uses K/2 of them: the trend).
* ``mean_future``: the L candidates with the lowest future score averaged over the continuations (what a scorer that
  regresses golden's future score approximates).
* ``scorer`` (with ``--scorer``): a trained scorer's recall@L at the same state, for comparison.

Two kinds of state: golden's own trajectory (where the evaluation's recall@L is measured; golden reached it knowing
the reference's future, which the continuations do not share, so there the ceiling is an estimate that a scorer reading
the state could in principle beat) and, with a scorer, the scorer's own trajectory (decided by the past alone: the
reference's future and the continuations are exchangeable there, and the ceiling estimates the Bayes limit at that
state). Every figure is per (layer, KV head) and is averaged over them per trace; intervals are 95% bootstraps over
traces.

    python -m studies.realbench.predictability --recipe recipes/smollm2-135m-realbench.yaml --problems 16 --continuations 8 \\
        --scorer scorers/smollm2-135m/sft --out runs/predictability

Each finished trace is written to ``OUT/rows.json`` at once; a killed run resumes from the traces it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch

from foresight.data import prompts

from foresight.runtime import atomic
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import load_recipe, parse_budgets
from foresight.engine.generate import Decoding, GenerateOptions, generate
from foresight.targets.golden import GoldenPolicy, block_pooled_attention
from foresight.engine.rollout import rollout
from foresight.scorers.bank import LearnedPolicy, ScorerBank
from foresight.engine.selection import select_topk, topk_overlap
from studies.realbench.predictability_summary import STATES, predictability_table, summary



@dataclasses.dataclass(frozen=True)
class Probe:
    """What the measurement runs: ``problems`` held-out references, ``continuations`` per reference written from its
    first ``position`` tokens (an eviction point of every budget; 0: the first one past half the shortest trace)."""

    problems: int = 16
    continuations: int = 8
    position: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.problems < 1:
            raise ValueError(f"problems must be >= 1, got {self.problems}")
        if self.continuations < 2:
            raise ValueError(f"continuations must be >= 2 (the ceiling needs a distribution), got {self.continuations}")


def eviction_step_at(position: int, settings: EvictionSettings, prefix: int = 0) -> int:
    """The eviction step that runs once the cache has seen ``position`` tokens (step t follows block t, i.e. the
    tokens up to prefix + B + (t+1)·L); a position where no eviction runs is an error."""
    over = position - prefix - settings.budget
    if over < settings.interval or over % settings.interval:
        raise ValueError(f"position {position} is not an eviction point of B={settings.budget}, L={settings.interval}"
                         f" (those are {prefix + settings.budget} + k·{settings.interval}, k >= 1)")
    return over // settings.interval - 1


def default_position(budgets: list[tuple[int, int]], shortest: int) -> int:
    """The first position past half the shortest trace where every budget evicts, with room for a future."""
    p = shortest // 2
    while p < shortest - 1:
        if all((p - B) >= L and (p - B) % L == 0 for B, L in budgets):
            return p
        p += 1
    raise ValueError(f"no common eviction point of the budgets {budgets} in the second half of a {shortest}-token trace")


@dataclasses.dataclass
class State:
    """A trajectory's state at one eviction step (one row; [nl, h, ...])."""

    token: torch.Tensor  # [nl, h, n] token index of each slot
    evictable: torch.Tensor  # [nl, h, n] candidates
    chosen: torch.Tensor  # [nl, h, L] the trajectory's own evictions (slot indices)
    scorer: torch.Tensor | None  # [nl, h, L] a scorer's evictions on the same view


@torch.no_grad()
def state_at(model, ids: torch.Tensor, settings: EvictionSettings, step: int, policy, bank=None) -> State:
    """The state of ``policy``'s rollout of the trace ``ids`` [1, S] at eviction ``step``; with a scorer ``bank`` also
    the scorer's top-L on that state."""
    position = settings.budget + (step + 1) * settings.interval
    found: dict = {}

    def rec(st):
        if st["step"] != step:
            return
        found.update(token=st["token"][:, 0], evictable=st["evictable"][:, 0], chosen=st["chosen"][:, 0])
        if bank is not None:
            scores = LearnedPolicy(bank).score(st["view"]).float()
            found["scorer"] = select_topk(scores, st["evictable"], settings.interval)[:, 0]

    rollout(model, ids[:, :position + 1], policy, settings, recorder=rec)  # the eviction runs before the next token
    if not found:
        raise RuntimeError(f"the rollout never reached eviction step {step} (position {position})")
    return State(found["token"], found["evictable"], found["chosen"], found.get("scorer"))


def golden_state(model, ids: torch.Tensor, settings: EvictionSettings, step: int, bank=None, pool: str = "mean") -> State:
    """Golden's own trajectory of ``ids`` (its future known) at eviction ``step``."""
    return state_at(model, ids, settings, step, GoldenPolicy(block_futures(model, ids, settings, pool)[0]), bank)


def block_futures(model, traces: torch.Tensor, settings: EvictionSettings, pool: str = "mean") -> list[torch.Tensor]:
    """Golden's future scores of every trace of ``traces`` [K, S]: one [nl, blocks, h, S] each."""
    return block_pooled_attention(model, traces, settings, pool).futures()


def at_step(futures: list[torch.Tensor], step: int, token: torch.Tensor) -> torch.Tensor:
    """The future scores at ``step`` of the slots ``token`` [nl, h, n], under each of ``futures``: [K, nl, h, n] (0 for
    empty slots)."""
    idx = token.clamp(min=0)
    return torch.stack([f[:, step].gather(-1, idx) for f in futures]).masked_fill(token < 0, 0.0)


def compare(golden: torch.Tensor, cand: torch.Tensor, futures: torch.Tensor, interval: int,
            choices: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Per layer [nl] (mean over KV heads): the module docstring's figures for golden's evictions ``golden``
    [nl, h, L] among the candidates ``cand`` [nl, h, n] under the reference's future, the candidates' future scores
    ``futures`` [K, nl, h, n] under K other continuations, and the recall@L of other ``choices`` ({name: [nl, h, L]})."""
    L, K = interval, futures.shape[0]
    per_k = torch.stack([select_topk(-f, cand, L) for f in futures])  # [K, nl, h, L]: golden under each future
    out = {"agreement": torch.stack([topk_overlap(p, golden) for p in per_k]).mean(0)}

    def by_frequency(members: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros((members.shape[0],) + cand.shape, device=cand.device).scatter_(-1, members, 1.0).sum(0)
        # the most often dropped first; among equal counts (integers, 2 apart) the lowest mean future (within [0, 1])
        return select_topk(2.0 * counts - f.mean(0).clamp(0, 1), cand, L)

    out["ceiling"] = topk_overlap(by_frequency(per_k, futures), golden)
    half = max(1, K // 2)
    out["ceiling_half"] = topk_overlap(by_frequency(per_k[:half], futures[:half]), golden)
    out["mean_future"] = topk_overlap(select_topk(-futures.mean(0), cand, L), golden)
    for name, chosen in (choices or {}).items():
        out[name] = topk_overlap(chosen, golden)
    return {k: v.mean(-1) for k, v in out.items()}


def measure_trace(model, ids: torch.Tensor, alt: torch.Tensor, settings: EvictionSettings, step: int,
                  bank=None, pool: str = "mean") -> dict[str, dict[str, torch.Tensor]]:
    """The figures of one reference ``ids`` [1, S] and its continuations ``alt`` [K, S] at eviction ``step``, per kind
    of state: ``golden`` (golden's trajectory under the reference's future: the states recall@L is measured on; they
    carry that future's choices, which the continuations do not share) and, with a scorer, ``scorer`` (the scorer's
    own top-L trajectory: a state the past alone decided, so the reference's future and the continuations are
    exchangeable there and the ceiling is a clean estimate). ``pool``: golden's pooling (``sft.golden_pool``)."""
    own, others = block_futures(model, ids, settings, pool), block_futures(model, alt, settings, pool)
    states = {"golden": state_at(model, ids, settings, step, GoldenPolicy(own[0]), bank)}
    if bank is not None:
        states["scorer"] = state_at(model, ids, settings, step, LearnedPolicy(bank))
    out = {}
    for kind, st in states.items():
        golden = select_topk(-at_step(own, step, st.token)[0], st.evictable, settings.interval)
        mine = st.scorer if kind == "golden" else st.chosen
        out[kind] = compare(golden, st.evictable, at_step(others, step, st.token), settings.interval,
                            {"scorer": mine} if mine is not None else None)
    return out


@torch.no_grad()
def continuations(model, ids: torch.Tensor, position: int, k: int, decoding: Decoding, seed: int) -> torch.Tensor:
    """``k`` continuations [k, S] of the first ``position`` tokens of ``ids`` [1, S] to its full length S, sampled
    with ``decoding`` (EOS held off: the references are as long), each row seeded on its own."""
    S = ids.shape[1]
    new = S - position
    dec = dataclasses.replace(decoding, min_tokens=new)
    prefix = ids[:, :position].expand(k, -1).contiguous()
    gens = [torch.Generator(device=ids.device).manual_seed(seed + j) for j in range(k)]
    out = generate(model, prefix, torch.ones_like(prefix), max_new_tokens=new, decoding=dec,
                   options=GenerateOptions(row_generators=gens))
    return torch.cat([prefix, out.new_tokens[:, :new]], 1)


def stored_continuations(folder: Path, key: dict, make) -> torch.Tensor:
    """``make()``'s continuations, kept in ``folder`` under ``key`` (a rerun with another scorer reuses them)."""
    f = folder / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.json"
    if f.exists():
        return torch.tensor(json.loads(f.read_text())["ids"])
    ids = make()
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_json(f, {"key": key, "ids": ids.tolist()})
    return ids


def run(recipe, probe: Probe, out: Path, scorer: Path | None = None, log=print) -> dict:
    """The measurement (module docstring) on the recipe's held-out references; writes ``rows.json``,
    ``summary.json`` and ``summary.md`` into ``out`` (and the continuations, reused by a rerun with another scorer,
    into ``out/continuations``) and returns the summary."""
    from foresight.scorers.checkpoint import load_scorer
    from foresight.engine.models import load_model
    from foresight.data.references import reference_traces

    out.mkdir(parents=True, exist_ok=True)
    budgets = parse_budgets(recipe.eval.budgets)
    model, tok = load_model(recipe.model)
    device = next(model.parameters()).device
    bank = load_scorer(scorer, model, device)[0] if scorer else None
    if bank is not None and not isinstance(bank, ScorerBank):
        raise ValueError(f"--scorer {scorer}: a ForesightKV scorer checkpoint is needed (this one is "
                         f"{type(bank).__name__}, whose decisions are not made at eviction steps)")
    problems = prompts.heldout_prompts(recipe.task, recipe.traces, probe.problems, tok)
    refs = reference_traces(recipe, model, tok, problems, device, use_cache=recipe.eval.cache_references, log=log)
    position = probe.position or default_position(budgets, min(r["ids"].shape[1] for r in refs))
    # the evaluation's golden path: the recipe's sinks and window, top-L, the prompt not protected
    along = {(B, L): recipe.cache.replace(budget=B, interval=L, selection="topk", temperature=1.0, protect_prompt=False,
                                          prompt_overflow="evict") for B, L in budgets}
    steps = {b: eviction_step_at(position, s) for b, s in along.items()}
    decoding = Decoding.from_recipe(recipe.traces, tok, do_sample=recipe.eval.do_sample)
    sampling = {"model": recipe.model.path, "dtype": recipe.model.dtype, "position": position, "seed": probe.seed,
                "decoding": dataclasses.asdict(decoding)}
    identity = json.loads(json.dumps({**sampling, "budgets": budgets, "probe": dataclasses.asdict(probe),
                                      "scorer": str(scorer) if scorer else None, "golden_pool": recipe.sft.golden_pool,
                                      "settings": [s.key() for s in along.values()]}))
    rows_file = out / "rows.json"
    saved = json.loads(rows_file.read_text()) if rows_file.exists() else {}
    rows = saved.get("rows", []) if saved.get("identity") == identity else []
    done = {r["problem"] for r in rows}
    for i, (p, ref) in enumerate(zip(problems, refs)):
        if p.index in done:
            continue
        if ref["ids"].shape[1] <= position + 1:
            log(f"[predictability] problem {p.index}: {ref['ids'].shape[1]} tokens, no future after {position}; skipped")
            continue
        t0 = time.time()
        seed = probe.seed * 1_000_003 + p.index * 1_000
        key = {**sampling, "reference": ref["ids"][0].tolist(), "continuations": probe.continuations}
        alt = stored_continuations(out / "continuations", key, lambda: continuations(
            model, ref["ids"], position, probe.continuations, decoding, seed)).to(device)
        for (B, L), step in steps.items():
            figs = measure_trace(model, ref["ids"], alt, along[(B, L)], step, bank, recipe.sft.golden_pool)
            for kind, f in figs.items():
                rows.append({"problem": p.index, "states": kind, "budget": f"{B}:{L}", "step": step,
                             **{k: round(v.mean().item(), 5) for k, v in f.items()},
                             "per_layer": {k: [round(x, 4) for x in v.tolist()] for k, v in f.items()}})
        atomic.write_json(rows_file, {"identity": identity, "rows": rows})
        log(f"[predictability] {i + 1}/{len(problems)} problem {p.index}: {time.time() - t0:.0f} s")
    summ = summary(rows)
    atomic.write_json(out / "summary.json", {"identity": identity, "states": STATES, "summary": summ}, indent=1)
    atomic.write_text(out / "summary.md", f"# Predictability of golden eviction at position {position}\n\n"
                      + predictability_table(summ, probe.continuations))
    return summ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-135m-realbench.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--continuations", type=int, default=8)
    ap.add_argument("--position", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scorer", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/predictability"))
    a = ap.parse_args(argv)
    summ = run(load_recipe(a.recipe, a.overrides), Probe(a.problems, a.continuations, a.position, a.seed), a.out, a.scorer)
    print(predictability_table(summ, a.continuations))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
