"""What a recipe's values may be: checked when the recipe is read, so a bad value fails before any work starts, with
every problem named by its ``section.field``."""

from __future__ import annotations

import re

SCORER_INPUTS = ("key", "value", "attn", "heads", "ahead", "age")  # what a scorer may read, in input order


class RecipeError(ValueError):
    """A recipe or an override is malformed."""


def at_least(lo):
    return lambda v: None if v >= lo else f"must be >= {lo}"


def none_or(rule):  # an optional setting: null, or a value the rule accepts
    return lambda v: None if v is None else rule(v)


def above(lo):
    return lambda v: None if v > lo else f"must be > {lo}"


def within(lo, hi):  # lo < v <= hi
    return lambda v: None if lo < v <= hi else f"must be in ({lo}, {hi}]"


SELECTIONS = ("topk", "sample", "multinomial")  # how the L pairs to evict are picked from the scores
PAIR_WEIGHTS = ("uniform", "gap")  # how SFT's hinge weighs a pair: alike (the paper's) or by its future-score gap


def one_of(*choices):
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def subset_of(*choices):
    return lambda v: None if v and set(v) <= set(choices) else f"must be a non-empty list of {', '.join(choices)}"


def scorer_inputs(v):
    """scorer.features: a non-empty list of input groups, at least one of them read from the cache's pairs (age alone
    ranks every head's pairs the same way)."""
    bad = subset_of(*SCORER_INPUTS)(v)
    if bad:
        return bad
    return None if set(v) - {"age"} else "must hold key, value or attn besides age"


def device(v):
    return None if re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) else "must be auto, cpu, mps, cuda or cuda:N"


def parse_budgets(spec: str) -> list[tuple[int, int]]:
    """'512:128,1024:256' -> [(512, 128), (1024, 256)]; each needs 0 < L < B."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            b, l = item.split(":")
            out.append((int(b), int(l)))
        except ValueError:
            raise RecipeError(f"budget {item!r} must look like BUDGET:INTERVAL, e.g. 512:128") from None
        if not 0 < out[-1][1] < out[-1][0]:
            raise RecipeError(f"budget {item!r}: the interval L must be > 0 and smaller than the budget B")
    if not out:
        raise RecipeError("no budgets given")
    return out


def budgets(v):
    try:
        parse_budgets(v)
    except RecipeError as e:
        return str(e)
    return None


def budgets_or_none(v):
    return budgets(v) if v else None


def names(v):
    return None if [x for x in v.split(",") if x.strip()] else "names no method"


RULES = {
    "model.dtype": one_of("float32", "bfloat16", "float16"), "model.device": device,
    "task.kind": one_of("ledger", "math", "none"), "task.facts": at_least(1), "task.variables": at_least(0),
    "task.filler": at_least(0), "task.scratch": at_least(0),
    "traces.num_prompts": at_least(0), "traces.batch_size": at_least(1), "traces.min_new_tokens": at_least(0),
    "traces.min_tokens": at_least(0),
    "traces.max_new_tokens": at_least(1), "traces.temperature": above(0), "traces.top_p": within(0, 1),
    "traces.top_k": at_least(0), "traces.loss_chunk": at_least(1), "traces.heldout_offset": at_least(0),
    "traces.engine": one_of("hf", "openai"), "traces.concurrency": at_least(1), "traces.request_timeout": above(0),
    "traces.max_retries": at_least(0),
    "cache.temperature": above(0),
    "scorer.hidden": at_least(1), "scorer.activation": one_of("gelu", "relu", "silu", "tanh"),
    "scorer.features": scorer_inputs,
    "sft.steps": at_least(1), "sft.batch_traces": at_least(1), "sft.lr": above(0), "sft.warmup": at_least(0),
    "sft.schedule": one_of("cosine", "constant"), "sft.margin": at_least(0), "sft.pairs": one_of("all", "sampled", "boundary"),
    "sft.pair_weight": one_of(*PAIR_WEIGHTS),
    "sft.sampled_pairs": at_least(1), "sft.val_traces": at_least(0),
    "sft.example_steps": at_least(0), "sft.example_seed": none_or(at_least(0)), "sft.pair_chunk": at_least(1),
    "sft.golden_pool": one_of("mean", "max", "output", "loss"),
    "sft.budgets": budgets_or_none,
    "sft.grad_clip": above(0), "sft.ckpt_every": at_least(1), "sft.objective": one_of("foresight", "kvpop"),
    "grpo.steps": at_least(1), "grpo.traces_per_step": at_least(1), "grpo.group": at_least(2), "grpo.lr": above(0),
    "grpo.warmup": at_least(0), "grpo.clip_eps": above(0), "grpo.epochs": at_least(1), "grpo.beta": at_least(0),
    "grpo.eta": at_least(0), "grpo.low_entropy_share": within(0, 1),
    "grpo.normalise": one_of("low_entropy", "counted"), "grpo.temperature": above(0), "grpo.ratio": one_of("set", "draw"),
    "grpo.ckpt_every": at_least(1), "grpo.budgets": budgets_or_none,
    "grpo.val_traces": at_least(0),
    "kvpop.scorer": one_of("mlp", "mlstm"), "kvpop.sinks": at_least(0), "kvpop.window": at_least(0),
    "kvpop.gamma": within(0, 1), "kvpop.decay_step": at_least(1), "kvpop.eps": above(0),
    "kvpop.agg": one_of("max", "mean"), "kvpop.tau": above(0), "kvpop.margin": at_least(0),
    "kvpop.balance_min": above(0), "kvpop.balance_max": above(0), "kvpop.queries_per_trace": at_least(0),
    "kvpop.hidden": at_least(1), "kvpop.memory_dim": at_least(1), "kvpop.block": at_least(1),
    "eval.num_problems": at_least(1), "eval.budgets": budgets, "eval.methods": names, "eval.n_samples": at_least(1),
    "eval.batch_size": at_least(1), "eval.scorer_selection": one_of(*SELECTIONS), "eval.scorer_temperature": above(0),
}


def check_recipe(recipe) -> None:
    """Raise a :class:`RecipeError` listing every value of ``recipe`` outside its range (see ``RULES``)."""
    problems = []
    for key, rule in RULES.items():
        section, field = key.split(".")
        value = getattr(getattr(recipe, section), field)
        msg = rule(value)
        if msg:
            problems.append(f"{key}={value!r}: {msg}")
    try:
        recipe.cache.validate()
    except ValueError as e:
        problems.append(f"cache: {e}")
    if recipe.traces.engine == "openai" and not recipe.traces.base_url:
        problems.append("traces.engine=openai needs traces.base_url (the server's API root, e.g. http://localhost:8000/v1)")
    if recipe.kvpop.balance_min > recipe.kvpop.balance_max:
        problems.append("kvpop.balance_min must be <= kvpop.balance_max")
    if problems:
        raise RecipeError("invalid recipe: " + "; ".join(problems))
