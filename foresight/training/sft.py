"""Stage one (``foresight sft``): scorers learn the Golden Eviction ranking with a pairwise hinge loss.

For every training trace: golden future scores (:mod:`foresight.targets.golden`), then one teacher-forced pass that
*follows the golden decisions* (so the features are exactly what the engine produces along that trajectory)
yields, per eviction step, the scorer inputs of all candidates. Loss (paper §3.2; :mod:`foresight.training.ranking`)::

    L = mean_{layers, rows} mean_{(i, j) in row : F_i < F_j} max(0, m − (φ_i − φ_j))

a row being one (layer, step, KV head); ``F`` the golden future score, ``φ`` the scorer's eviction score (i
should go before j). ``sft.pairs = all`` uses every pair (chunked), ``sampled`` a random subset of
``sft.sampled_pairs`` pairs per row. ``sft.pair_weight = gap`` weights each pair by ``F_j − F_i``, the future
attention that evicting j instead of i would lose, so that the many near-ties among pairs nobody will attend to (whose
order costs nothing) do not outweigh the few costly ones; ``uniform`` (the paper's) weights every pair alike.
Metrics: loss, recall@L of the scorer's eviction set against the golden set (per layer), learning rate — to
TensorBoard (``OUT/tb``); on the validation traces also the future score the scorer's evictions lose relative to
golden's (``val_lost_future_ratio``, 1 = golden), which weighs each miss by what it costs where recall@L does not.

Checkpoints: ``OUT/ckpt/state.pt`` every ``sft.ckpt_every`` steps (atomic); ``--resume`` continues exactly
(batches depend only on the step number and the seed). The final scorers are a standalone checkpoint in OUT.
Multi-process: ``deepspeed --num_gpus N -m foresight sft ... --deepspeed recipes/ds/zero2.json``; each rank
takes a disjoint share of every batch and DeepSpeed averages the gradients. That plumbing is shared with the other
training stages (:mod:`foresight.training.runs`). ``foresight sft --set sft.objective=kvpop`` trains KVpop scorers
instead, with :func:`foresight.training.kvpop.train_kvpop` (the command line picks the stage).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from foresight.runtime import distributed
from foresight.engine.models import portable_path
from foresight.scorers.checkpoint import load_scorer, read_config
from foresight.config.recipe import parse_budgets
from foresight.training.golden_store import GoldenStore, golden_examples
from foresight.runtime.locks import locks_output
from foresight.training.ranking import HingeSettings, lost_future, pairwise_hinge, recall_at_l
from foresight.evaluation.report import bootstrap_ci
from foresight.scorers.bank import ScorerBank, bank_for_model
from foresight.data.trace_data import training_fingerprints
from foresight.data.stage_inputs import load_stage_inputs
from foresight.training.outputs import RunOutput, finish_run, progress_bar, save_snapshot, summary_writer
from foresight.training.runs import TrainState, resumed_extra, run_identity, setup_training, train_plan
from foresight.training.steps import full_state_dict, mean_step, save_progress


def budgets_loss(bank, groups, cfg, generator=None):
    """Mean over budgets of :func:`example_loss` (``groups``: one ``(interval, examples)`` per training budget) and
    the per-layer recall, averaged the same way."""
    losses, recalls = zip(*(example_loss(bank, ex, cfg, interval, generator) for interval, ex in groups))
    return torch.stack(losses).mean(), torch.stack(recalls).mean(0)


def training_settings(recipe) -> list:
    """The eviction settings of SFT's examples: one per ``sft.budgets`` entry, or the cache's own."""
    if not recipe.sft.budgets:
        return [recipe.cache]
    return [recipe.cache.replace(budget=B, interval=L) for B, L in parse_budgets(recipe.sft.budgets)]


def example_rows(bank, examples):
    """The scorer's eviction scores, golden's future scores and the candidate masks of a trace's golden steps, each
    [layers, rows, n] (rows = step × head)."""
    nl = bank.num_layers
    phis, futs, cands = [], [], []
    for x, f, c in examples:
        phis.append(bank(x, folded=True).reshape(nl, -1, x.shape[3]))
        futs.append(f.reshape(nl, -1, x.shape[3]))
        cands.append(c.reshape(nl, -1, x.shape[3]))
    return torch.cat(phis, 1), torch.cat(futs, 1), torch.cat(cands, 1)


def example_loss(bank, examples, cfg, interval, generator=None):
    """Loss and per-layer recall over a trace's golden steps (rows = layer × step × head)."""
    return rows_loss(example_rows(bank, examples), cfg, interval, generator)


def rows_loss(rows, cfg, interval, generator=None):
    """:func:`example_loss` of rows already scored (:func:`example_rows`)."""
    phi, fut, cand = rows
    nl = phi.shape[0]
    loss, _ = pairwise_hinge(phi.flatten(0, 1), fut.flatten(0, 1), cand.flatten(0, 1),
                             HingeSettings.from_sft(cfg, interval), generator)
    with torch.no_grad():
        rec = recall_at_l(phi.flatten(0, 1), fut.flatten(0, 1), cand.flatten(0, 1), interval).view(nl, -1).mean(1)
    return loss, rec


@torch.no_grad()
def lost_future_ratio(scored) -> float:
    """Over a trace's golden steps (``scored``: one ``(interval, rows)`` per budget, rows from :func:`example_rows`):
    the future score that the scorer's evictions lose, summed over every row, divided by golden's (1 = golden's choice;
    recall@L, by contrast, counts a swap of two pairs nothing attends to as much as a costly one)."""
    sums = torch.zeros(2)
    for interval, (phi, fut, cand) in scored:
        sums += lost_future(phi.flatten(0, 1).float(), fut.flatten(0, 1).float(), cand.flatten(0, 1), interval).sum(0)
    return (sums[0] / sums[1].clamp(min=1e-12)).item()


@torch.no_grad()
def validation_scores(bank, groups, cfg) -> tuple[list, list]:
    """SFT's validation on golden's states: for each trace's groups (one ``(interval, examples)`` per budget), per
    budget (loss, per-layer recall), the pairs drawn as :func:`budgets_loss` does, and the lost-future ratio of the
    same scored rows."""
    per, lost = [], []
    for trace_groups in groups:
        gen = torch.Generator().manual_seed(0)
        scored = [(k, example_rows(bank, ex)) for k, ex in trace_groups]
        per.append([rows_loss(rows, cfg, k, gen) for k, rows in scored])
        lost.append(lost_future_ratio(scored))
    return per, lost


# ------------------------------------------------------------------------------------------------ training
def step_traces(cfg, train_idx: list[int], step: int) -> list[int]:
    """The training traces of SFT step ``step`` (``sft.batch_traces`` drawn with replacement, seeded by the step)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    return [rng.choice(train_idx) for _ in range(cfg.batch_traces)]


def start_from(cfg, model, bank, log):
    """Load ``sft.init`` (or ``sft.onpolicy``, which starts from the scorer whose states it adds) into ``bank``;
    returns the loaded scorer, or None."""
    if cfg.init and cfg.onpolicy and cfg.init != cfg.onpolicy:
        raise ValueError(f"sft.init={cfg.init} and sft.onpolicy={cfg.onpolicy}: a DAgger round starts from the "
                         "scorer whose states it adds; set one of them")
    path = cfg.init or cfg.onpolicy
    if not path:
        return None
    init, init_cfg = load_scorer(Path(path), model)
    if not isinstance(init, ScorerBank) or init.spec() != bank.spec():
        raise ValueError(f"sft.init/onpolicy={path}: its scorer ({init_cfg.get('scorer')}) is not the recipe's "
                         f"(scorer: hidden={bank.hidden}, activation={bank.activation}, features={list(bank.features)})")
    bank.load_state_dict(init.state_dict())
    log(f"[sft] starting from {path}")
    return init


def golden_stores(recipe, model) -> list[GoldenStore]:
    """The stores of golden examples SFT reads, one per training budget (none with ``sft.example_steps = 0``): every
    run of the same model, eviction settings, pooling and example seed shares them."""
    cfg = recipe.sft
    if not cfg.example_steps:
        return []
    return [GoldenStore(model, s, cfg.golden_pool, cfg.example_steps, example_seed(cfg)) for s in
            training_settings(recipe)]


def example_seed(cfg) -> int:
    """The seed that picks each trace's stored eviction steps: ``sft.example_seed``, else ``sft.seed`` (so two seeds
    of a setting share one golden store only when asked to)."""
    return cfg.seed if cfg.example_seed is None else cfg.example_seed


def onpolicy_store(cfg, recipe, model, init) -> GoldenStore | None:
    """``sft.onpolicy``: the store of the scorer ``init``'s own trajectory's states, labelled by golden (see
    :mod:`foresight.training.golden_store`); None without it."""
    if not cfg.onpolicy:
        return None
    if not cfg.example_steps:
        raise ValueError("sft.onpolicy needs sft.example_steps > 0: the states of its trajectory are stored examples")
    if cfg.budgets:
        raise ValueError(f"sft.onpolicy follows the scorer at the cache's budget only; leave sft.budgets "
                         f"({cfg.budgets!r}) empty")
    return GoldenStore(model, recipe.cache, cfg.golden_pool, cfg.example_steps, example_seed(cfg), behaviour=init)


@locks_output("sft")
def train_sft(recipe, traces_dir, out, resume: bool = False, deepspeed_config=None, progress: bool = True, log=print):
    out = Path(out)
    cfg, interval = recipe.sft, recipe.cache.interval
    rank, world = distributed.rank_world()
    if cfg.objective == "kvpop":
        raise ValueError("sft.objective='kvpop' is trained by foresight.training.kvpop.train_kvpop")
    if cfg.objective != "foresight":
        raise ValueError(f"sft.objective={cfg.objective!r} is not available (foresight | kvpop)")
    device, model, ds, train_idx, val_idx = load_stage_inputs(recipe.sft, recipe.model, traces_dir, world)
    bank = bank_for_model(model, recipe.scorer.hidden, recipe.scorer.activation, recipe.scorer.features, cfg.seed)
    init = start_from(cfg, model, bank, log)  # before the optimiser (and DeepSpeed's partitioning) sees the weights
    plan = train_plan(cfg, identity=run_identity(recipe, ("model", "cache", "scorer", "sft"), ds))
    opt, sched, ckpt, start, engine = setup_training(bank, plan, out, resume, rank, deepspeed_config, "SFT", log)

    cache_examples: dict[tuple[int, int], list] = {}
    settings = training_settings(recipe)
    stores = golden_stores(recipe, model)
    onpolicy = onpolicy_store(cfg, recipe, model, init)
    if rank == 0:  # every trace's examples at once, in batches (then shared by every rank)
        for st in stores + [onpolicy]:
            if st is not None:
                st.fill(train_idx + val_idx, ds, progress=progress)
    distributed.barrier()

    def golden_states(i, k):  # the examples along golden's trajectory under the k-th training budget
        if stores:
            return stores[k].examples(ds[i], bank)
        if (i, k) in cache_examples:
            return cache_examples[(i, k)]
        row = ds[i]
        ids = torch.tensor([row["input_ids"]], device=device)
        ex = golden_examples(model, ids, bank, settings[k], cfg.golden_pool, prompt_len=row["prompt_len"])
        if cfg.cache_golden:
            cache_examples[(i, k)] = ex
        return ex

    def groups_for(i, own: bool = True):  # per budget; with sft.onpolicy, that scorer's states join the cache's budget
        extra = onpolicy.examples(ds[i], bank) if own and onpolicy is not None else []
        return [(s.interval, golden_states(i, k) + (extra if k == 0 else [])) for k, s in enumerate(settings)]

    writer = summary_writer(out, rank)
    init_cfg = read_config(Path(cfg.init or cfg.onpolicy)) if init is not None else None
    provenance = {"training_data": portable_path(traces_dir), "training_traces": training_fingerprints(ds, train_idx, init_cfg),
                  "recipe": recipe.to_dict()}
    run = RunOutput(out, model, recipe, "sft", provenance)
    bar = progress_bar(start, cfg.steps, "sft", progress, rank)
    t0 = time.time()
    last = resumed_extra(ckpt).get("last", {}) if start else {}  # a resumed run reports its latest metrics
    for step in bar:
        mine = step_traces(cfg, train_idx, step)[rank::world]
        for store in stores:  # the next step's files are read from disk while this step computes
            store.prefetch([ds[i] for i in step_traces(cfg, train_idx, step + 1)[rank::world]])
        gen = torch.Generator().manual_seed(cfg.seed * 7 + step)  # drawn from in the batch's order
        per_trace = mean_step(mine, lambda i: budgets_loss(bank, groups_for(i), cfg, gen), bank, opt, engine,
                              cfg.grad_clip)
        loss = torch.stack([x for x, _ in per_trace]).mean()
        recalls = [r for _, r in per_trace]
        if engine is None:
            sched.step()  # under DeepSpeed the engine steps the schedule it was given
        rec = torch.stack(recalls).mean(0)
        last = {"loss": loss.item(), "recall": rec.mean().item(), "lr": opt.param_groups[0]["lr"]}
        if writer is not None:
            writer.add_scalar("sft/loss", last["loss"], step)
            writer.add_scalar("sft/lr", last["lr"], step)
            for layer, r in enumerate(rec.tolist()):
                writer.add_scalar(f"sft/recall@L/layer{layer}", r, step)
        bar.set_postfix(loss=f"{last['loss']:.4f}", recall=f"{last['recall']:.3f}")
        save_progress(step, plan, TrainState(bank, opt, sched, ckpt, engine), rank, extra={"last": last},
                      snapshot=lambda w: save_snapshot(run, step + 1, w, bank, last))
    train_seconds = time.time() - t0
    metrics = {"train_loss": round(last.get("loss", float("nan")), 5),
               "train_recall_at_L": round(last.get("recall", float("nan")), 4), "steps": cfg.steps,
               "train_seconds_this_run": round(train_seconds, 1)}
    if val_idx:
        with torch.no_grad():  # on golden's states: comparable between runs, with or without sft.onpolicy
            per, lost = validation_scores(bank, (groups_for(i, own=False) for i in val_idx), cfg)
            vals = [(torch.stack([p[0] for p in t]).mean(), torch.stack([p[1] for p in t]).mean(0)) for t in per]
            if len(settings) > 1:  # each training budget's recall on its own
                metrics["val_recall_at_L_per_budget"] = {
                    f"{s.budget}:{s.interval}": round(sum(t[k][1].mean().item() for t in per) / len(per), 4)
                    for k, s in enumerate(settings)}

            def mean_recall(examples_of, k: int) -> float:  # over the validation traces
                return round(sum(example_loss(bank, examples_of(i), cfg, k, torch.Generator().manual_seed(0))[1]
                                 .mean().item() for i in val_idx) / len(val_idx), 4)

            if onpolicy is not None:  # and on the states of the sft.onpolicy scorer
                metrics["val_recall_at_L_onpolicy_states"] = mean_recall(lambda i: onpolicy.examples(ds[i], bank),
                                                                         interval)
        metrics["val_loss"] = round(torch.stack([v[0] for v in vals]).mean().item(), 5)
        metrics["val_recall_at_L"] = round(torch.stack([v[1] for v in vals]).mean().item(), 4)
        ci = bootstrap_ci([v[1].mean().item() for v in vals])  # over the validation traces
        if ci is not None and len(vals) > 1:
            metrics["val_recall_at_L_lo"], metrics["val_recall_at_L_hi"] = (round(x, 4) for x in ci)
        metrics["val_traces"] = len(val_idx)
        metrics["val_recall_at_L_per_layer"] = [round(x, 4) for x in torch.stack([v[1] for v in vals]).mean(0).tolist()]
        metrics["val_lost_future_ratio"] = round(sum(lost) / len(lost), 4)
        ci = bootstrap_ci(lost)
        if ci is not None and len(lost) > 1:
            metrics["val_lost_future_ratio_lo"], metrics["val_lost_future_ratio_hi"] = (round(x, 4) for x in ci)
    weights = full_state_dict(bank, engine)
    if engine is not None and engine.zero_optimization_stage() == 3:
        bank = bank_for_model(model, recipe.scorer.hidden, recipe.scorer.activation, recipe.scorer.features)
        bank.load_state_dict(weights)  # a plain, unpartitioned copy for saving and for the caller
    finish_run(run, rank, world, weights, bank, metrics, writer, log)
    return bank, metrics
