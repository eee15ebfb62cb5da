"""``foresight eval``: every method on the same held-out problems, the same traces and the same engine.

For each (method, budget B:L) it reports, on ``eval.num_problems`` held-out problems:

* ``loss_ratio`` — Σ NLL of the solution tokens under eviction / Σ NLL with the full cache, teacher-forced on
  the model's own full-cache traces of those problems (paper Table 2);
* ``low_entropy_loss_increase`` / ``high_entropy_loss_increase`` — mean per-token loss increase after the first
  eviction on the lowest-80%-entropy tokens and on the rest (paper Table 1);
* ``accuracy`` — task accuracy of generation under eviction, pass@1 averaged over ``eval.n_samples`` seeded
  samples (avg@n; one greedy sample when ``eval.do_sample`` is false), by the task's checker; per problem in
  ``per_problem_solved``;
* ``recall_at_L`` — overlap of the method's L evictions with Golden Eviction's along the golden trajectory;
* ``keep_recall`` — at the same steps, the share of the candidates golden keeps that the method keeps too (KVpop's
  "top-k retention recall"; with B - L of ~B candidates kept, it is far higher than recall@L: 1 - L(1 - recall@L)/kept);
  both need golden's labels and a golden rollout, the costliest part on a CPU: ``eval.recall=false`` leaves them out;
* ``mean_cache``, ``peak_cache`` — pairs held per (sequence, layer, KV head) when a generated token attends, averaged
  over the generated tokens of the teacher-forced traces, and the most any of them saw (every method, the full cache's
  included);
* ``per_trace`` — each held-out trace's sums behind the ratios (evicted and full-cache loss, low- and high-entropy
  loss increase with their token counts) and its id, for paired comparisons (``foresight compare``);
* ``divergence`` (greedy decoding) — where generation under eviction first leaves the full-cache reference, and the
  teacher-forced loss increase and full-cache entropy at that token (:mod:`foresight.evaluation.divergence`).

Methods: ``full``, ``golden`` (teacher-forced only: it needs the future), ``kvpop-oracle`` (KVpop's teacher: the
true future-attention target under the recipe's ``kvpop`` layout; teacher-forced only), the heuristics of
:mod:`foresight.policies`, ``random-keep-prompt`` (random eviction with the prompt protected), and each ``--scorers
DIR`` (named ``foresight-<stage>``, or ``kvpop-<scorer>`` for KVpop checkpoints). ``eval.protect_prompt=true``
protects the prompt for every method; the tables say which rows did. Outputs in OUT: ``results.json``,
``results.md``, ``overview.png`` (accuracy and loss increase against the budget), ``accuracy.png``,
``loss_increase.png``, ``loss_ratio.png`` and ``eviction_map.png``. Everything is seeded: the same
command gives the same numbers.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from foresight.data import prompts

from foresight.engine.cache import layer_budgets

from foresight.runtime import atomic
from foresight.scorers.checkpoint import read_config, record_eval
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import EvalConfig
from foresight.targets.golden import GoldenPolicy
from foresight.targets.kvpop import KVpopOraclePolicy
from foresight.evaluation.divergence import divergence_table
from foresight.evaluation.generation import GenerationSettings, accuracy, divergences
from foresight.evaluation.labels import GoldenPasses, Labels
from foresight.evaluation.resume import eval_identity, finished_rows
from foresight.runtime.locks import locks_output
from foresight.evaluation.methods import Method, build_methods, check_names
from foresight.engine.models import load_model
from foresight.data.references import make_batch, reference_traces, trace_batches
from foresight.evaluation.report import results_table
from foresight.engine.rollout import RolloutOptions, rollout
from foresight.engine.attention_shape import AttentionShape
from foresight.evaluation.shared_prefixes import BatchPrefixes, SharedPrefixes
from foresight.evaluation.validation_references import check_references_unseen, validation_references
from foresight.evaluation.trace_metrics import TraceMetrics
from foresight.config.checks import parse_budgets


def teacher_forced(method: Method, model, batch: dict, settings: EvictionSettings, seed: int, future=None,
                   priorities=None, shared: BatchPrefixes | None = None):
    """Per-token losses [b, S] of a batch of traces under the method, and the pairs held at each token [b, S];
    ``shared``: the batch's shared prefixes (:meth:`SharedPrefixes.for_batch`), to continue from."""
    if method.is_full:  # token t of a trace attends to its t + 1 pairs
        S = batch["loss"].shape[1]
        seen = torch.arange(1, S + 1, dtype=torch.float32).expand(len(batch["lengths"]), S)
        return batch["loss"], seen * (seen <= torch.tensor(batch["lengths"])[:, None])
    if method.kind == "kvpop-oracle":
        pol = KVpopOraclePolicy(priorities, *method.layout)
    else:
        pol = GoldenPolicy(future) if method.kind == "golden" else method.make_policy()
    gen = torch.Generator(device=batch["ids"].device).manual_seed(seed)
    prefix = shared.get(pol, settings, batch) if shared is not None else None
    res = rollout(model, batch["ids"], pol, settings, prompt_len=batch["prompt_lens"][0],
                  attention_mask=batch["mask"],
                  options=RolloutOptions(gen, full=(batch["loss"], batch["entropy"]), entropy=False, prefix=prefix))
    return res.token_loss, res.held_per_token.cpu()


@dataclasses.dataclass
class Evaluation:
    """What every row of one evaluation shares: the model, the problems and their references batched both ways
    (``batchings[protect_prompt]``), the labels, golden's passes and the shared prefixes, and the settings the rows
    read (``eval``, ``cache.prompt_overflow`` and the generation's)."""

    model: torch.nn.Module
    tok: object
    device: torch.device
    problems: list
    refs: list[dict]
    batchings: dict
    labels: Labels
    passes: GoldenPasses
    prefixes: SharedPrefixes
    eval_cfg: EvalConfig
    overflow: str
    generation: GenerationSettings


def check_request(recipe, methods, budgets) -> tuple[list, list[str]]:
    """The (budget, interval) pairs and method names to evaluate, refused before any work when they cannot be."""
    eval_cfg = recipe.eval
    if eval_cfg.num_problems <= 0:
        raise ValueError(f"eval.num_problems must be > 0, got {eval_cfg.num_problems}")
    budget_list = parse_budgets(budgets or eval_cfg.budgets)
    for B, L in budget_list:
        EvictionSettings(budget=B, interval=L).validate()
    if recipe.cache.layer_budgets and eval_cfg.recall:
        raise ValueError("cache.layer_budgets: recall against golden is not measured with per-layer budgets (golden's "
                         "steps there are not the uniform ones); set eval.recall=false")
    return budget_list, check_names((methods or eval_cfg.methods).split(","))


def load_references(recipe, model, tok, device, scorers, log, progress) -> tuple[list, list[dict]]:
    """(problems, references): a traces folder's validation traces (``eval.traces``), else the held-out problems and
    their full-cache reference traces."""
    eval_cfg = recipe.eval
    if eval_cfg.traces:  # validation traces of a traces folder: nothing to generate
        problems, refs = validation_references(recipe, eval_cfg.traces, model, device, scorers, log=log)
        log(f"[eval] {len(refs)} validation traces of {eval_cfg.traces} (not the held-out references)")
        return problems, refs
    problems = prompts.heldout_prompts(recipe.task, recipe.traces, eval_cfg.num_problems, tok)
    log(f"[eval] {len(problems)} held-out problems; reference full-cache traces ...")
    refs = reference_traces(recipe, model, tok, problems, device, use_cache=eval_cfg.cache_references, log=log,
                            progress=progress)
    return problems, refs


def eval_meta(recipe, problems: list, refs: list[dict], seen_prompts) -> dict:
    """The evaluation's ``meta.json`` (without its duration)."""
    traces = recipe.eval.traces
    return {"recipe": recipe.name, "model": recipe.model.path, "num_problems": len(problems),
            "full_cache_trace_accuracy": None if recipe.task.kind == "none" else
            sum(bool(r["correct"]) for r in refs) / len(refs),
            "mean_trace_length": sum(r["ids"].shape[1] for r in refs) / len(refs),
            "mean_prompt_length": sum(r["prompt_len"] for r in refs) / len(refs),
            "references": f"validation traces of {Path(traces).resolve()}" if traces else "held-out",
            "references_with_a_training_prompt": seen_prompts}


def evaluate_row(ev: Evaluation, m: Method, B: int, L: int, protect_label, bar) -> dict:
    """The row of method ``m`` at budget ``B:L`` (``protect_label``: the table's protect_prompt entry)."""
    eval_cfg = ev.eval_cfg
    settings = m.settings(B, L, ev.overflow)
    metrics, along = TraceMetrics(), {}
    labelled = not m.is_full and (eval_cfg.recall or m.kind == "golden")  # golden's labels for this method
    for bi, batch in enumerate(ev.batchings[m.protect_prompt]):
        future = ev.labels.future(batch, settings) if labelled else None
        prio = ev.labels.priority(batch) if m.kind == "kvpop-oracle" else None
        seed = eval_cfg.seed * 7919 + bi
        if m.kind == "golden":  # golden's own rollout is the golden pass
            gp = ev.passes.get(m, B, L, settings, bi, batch, future, seed)
            loss, held = gp.loss, gp.held
        else:
            loss, held = teacher_forced(m, ev.model, batch, settings, seed, future, prio,
                                        ev.prefixes.for_batch((m.protect_prompt, bi)))
        metrics.add(loss, held, batch, protect_label is True, settings)
        along |= {i: loss[r, :n] for r, (i, n) in enumerate(zip(batch["members"], batch["lengths"]))}  # views
        if future is not None:
            metrics.add_recalls(batch, ev.passes.get(m, B, L, settings, bi, batch, future, seed).recalls.pop(m.name, []))
        bar.update(1)
    solved, n, sample = accuracy(m, ev.generation, ev.model, ev.tok, ev.problems, B, L, ev.device)
    bar.update(1)
    return ({"method": m.name, "budget": B, "interval": L, "protect_prompt": protect_label,
             "accuracy": None if solved is None else round(sum(solved) / len(solved), 4), "n_samples": n,
             "num_problems": len(ev.problems)} | metrics.row(eval_cfg.seed)
            | {"per_problem_solved": None if solved is None else [round(c, 4) for c in solved]}
            | {"divergence": None if sample is None or eval_cfg.do_sample else divergences(ev.refs, sample, along)})


def evaluate_rows(ev: Evaluation, jobs: list, done: dict, out: Path, progress: bool, log) -> list[dict]:
    """Every (method, budget) row of ``jobs`` in order: those in ``done`` as they were, the others evaluated, each
    written to ``results.json`` when finished; a protected prompt longer than the budget skips its row under
    ``cache.prompt_overflow=error``."""
    from tqdm import tqdm

    bar = tqdm(total=sum(len(ev.batchings[m.protect_prompt]) + 1 for m, _, _ in jobs), desc="eval", disable=not progress)
    max_prompt = max(r["prompt_len"] for r in ev.refs)
    rows = []
    for m, B, L in jobs:
        bar.set_postfix(method=m.name, budget=f"{B}:{L}")
        if ev.prefixes.budget != (B, L):
            ev.prefixes.clear((B, L))
        if (m.name, B, L) in done:
            rows.append(done[(m.name, B, L)])
            bar.update(len(ev.batchings[m.protect_prompt]) + 1)
            continue
        protect_label = m.protect_prompt
        if m.protect_prompt and max_prompt > B:
            if ev.overflow == "error":
                log(f"[eval] skipping {m.name} at B={B}: the prompt ({max_prompt} tokens) is longer than the budget "
                    "and is protected (set cache.prompt_overflow=evict to evict inside the prompt instead)")
                bar.update(len(ev.batchings[m.protect_prompt]) + 1)
                continue
            protect_label = "fallback"
        rows.append(evaluate_row(ev, m, B, L, protect_label, bar))
        atomic.write_json(out / "results.json", rows, indent=1)  # each finished row is on disk at once
    bar.close()
    return rows


def write_outputs(ev: Evaluation, rows: list[dict], meta: dict, meths: list[Method], budget_list: list,
                  out: Path, record: bool) -> None:
    """``results.json``, ``meta.json``, ``results.md``, the budget curves and the eviction map (of the last scorer,
    else golden, else the first evicting method, at the first budget); on ``record``, the scorers' model cards."""
    atomic.write_json(out / "results.json", rows, indent=1)
    atomic.write_json(out / "meta.json", meta, indent=1)
    atomic.write_text(out / "results.md", results_table(rows, meta) + divergence_table(rows))
    for m in meths:  # on request, the scorers' model cards carry their evaluation
        if record and m.checkpoint is not None:
            record_eval(m.checkpoint, rows, m.name)
    from foresight.evaluation import plots

    plots.budget_curves(rows, out, meta=meta)
    best = next((m for m in reversed(meths) if m.name.startswith("foresight")), None) or \
        next((m for m in meths if m.name == "golden"), None) or next((m for m in meths if not m.is_full), None)
    refs = ev.refs
    if best is not None and refs and not best.layer_budgets:  # the map records steps: uniform budgets only
        B, L = budget_list[0]
        prefix = best.settings(B, L, "evict").protected_prefix(refs[0]["prompt_len"])
        future = ev.labels.stored_future(0, B, L, prefix)
        if future is not None or not best.teacher_forced_only:  # golden's map needs its labels (resumed runs lack them)
            plots.eviction_map(ev.model, refs[0], best, B, L, future, out / "eviction_map.png")


@locks_output("eval")
def run_eval(recipe, out, methods=None, budgets=None, scorers=(), progress=True, log=print,
             record: bool = False) -> list[dict]:
    """Evaluate the methods at every budget (see the module docstring); resumes a killed run of the same evaluation
    in ``out`` from its finished rows. ``record``: also store each scorer checkpoint's rows in its ``config.json`` and
    model card (its inputs are otherwise never modified)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eval_cfg = recipe.eval
    budget_list, method_names = check_request(recipe, methods, budgets)
    identity = {"recipe": eval_identity(recipe), "methods": method_names, "budgets": budget_list,
                "scorers": [[str(d), read_config(d).get("created")] for d in scorers]}
    done = finished_rows(out, identity)
    atomic.write_json(out / "run.json", identity, indent=1)
    if done:
        log(f"[eval] resuming: {len(done)} finished rows in {out}")
    model, tok = load_model(recipe.model)
    device = next(model.parameters()).device
    meths = build_methods(method_names, list(scorers), model, eval_cfg.protect_prompt,
                          (recipe.kvpop.window, recipe.kvpop.sinks), (eval_cfg.scorer_selection, eval_cfg.scorer_temperature),
                          recipe.cache)
    num_layers = AttentionShape.of(model.config).num_layers
    for B, L in budget_list:  # every layer's share of every budget leaves room for an eviction (before any work)
        layer_budgets.check(layer_budgets.budgets(recipe.cache.layer_budgets, B, num_layers), L, L,
                            max(m.sinks for m in meths))
    t0 = time.time()
    problems, refs = load_references(recipe, model, tok, device, scorers, log, progress)
    seen_prompts = check_references_unseen(refs, scorers, log)
    batchings = {flag: [make_batch(refs, b, tok.pad_token_id) for b in trace_batches(refs, eval_cfg.batch_size, flag)]
                 for flag in (False, True)}
    meta = eval_meta(recipe, problems, refs, seen_prompts)
    atomic.write_json(out / "meta.json", meta, indent=1)  # with the rows finished so far, a stopped run can be reported
    prefixes = SharedPrefixes(model)  # the part before the first eviction, run once per batch and budget
    ev = Evaluation(model, tok, device, problems, refs, batchings, Labels(model, refs, recipe.sft.golden_pool, recipe.kvpop),
                    GoldenPasses(model, meths, done, eval_cfg.recall, prefixes), prefixes, eval_cfg,
                    recipe.cache.prompt_overflow, GenerationSettings(recipe.task, recipe.traces, eval_cfg))
    rows = evaluate_rows(ev, [(m, B, L) for (B, L) in budget_list for m in meths], done, out, progress, log)
    meta["seconds"] = round(time.time() - t0, 1)
    write_outputs(ev, rows, meta, meths, budget_list, out, record)
    log(results_table(rows, meta) + divergence_table(rows))
    return rows
