"""Resuming and extending an evaluation (``foresight eval``): which evaluation an output folder holds
(``run.json``: the recipe as far as it shapes the rows, methods, budgets, scorers) and the rows it already finished
(``results.json``), so that a killed evaluation continues and a larger one computes only its new rows."""

from __future__ import annotations

import json
from pathlib import Path


def finished_rows(out: Path, identity: dict) -> dict:
    """The rows a killed evaluation of the same run (``identity``) already wrote to ``out``, by (method, B, L). An
    evaluation that extends the one in ``out`` (same recipe; its methods and budgets a superset, its scorers the same
    ones followed by more) keeps those rows and computes only the new ones; an output folder of another evaluation
    is refused (nothing is overwritten)."""
    run, results = out / "run.json", out / "results.json"
    if not (run.exists() and results.exists()):
        return {}  # nothing finished yet
    if not extends(json.loads(run.read_text()), json.loads(json.dumps(identity))):
        raise ValueError(f"{out} holds another evaluation (other recipe, or methods, budgets or scorers that are not a "
                         "superset of its own): choose a new --out")
    return {(r["method"], r["budget"], r["interval"]): r for r in json.loads(results.read_text())}


def eval_identity(recipe) -> dict:
    """What of a recipe shapes an evaluation's rows: the model (not where or how its steps run), the task and the
    references' sampling (``traces``), the cache's settings, ``eval``, KVpop's method settings and golden's pooling.
    Training-only settings (``scorer``, the rest of ``sft``, ``grpo``) are left out: the scorers are checkpoints."""
    d = recipe.to_dict()
    keep = {k: d[k] for k in ("name", "task", "traces", "cache", "eval", "kvpop")}
    for name in ("whole_heads", "layer_budgets"):  # empty: the identity evaluations had before these existed
        if not keep["cache"].get(name):
            keep["cache"] = {k: v for k, v in keep["cache"].items() if k != name}
    sft = {"golden_pool": recipe.sft.golden_pool}
    if recipe.eval.traces is None:  # held-out references: the identity evaluations had before eval.traces existed
        del keep["eval"]["traces"]
    else:  # validation traces: which ones is sft.val_traces'
        sft["val_traces"] = recipe.sft.val_traces
    return keep | {"model": {k: v for k, v in vars(recipe.model).items() if k not in ("device", "step")}, "sft": sft}


def _within(new, old) -> bool:
    """``new`` (a recipe identity) agrees with ``old`` on every field it has (an older run.json may hold more)."""
    if isinstance(new, dict):
        return isinstance(old, dict) and all(k in old and _within(v, old[k]) for k, v in new.items())
    return new == old


def extends(old: dict, new: dict) -> bool:
    """Whether evaluation ``new`` contains evaluation ``old``: the same recipe (as far as it shapes the rows:
    :func:`eval_identity`), every method and budget of ``old``, and ``old``'s scorer checkpoints first (so that the
    scorers' method names are unchanged)."""
    return (_within(new["recipe"], old["recipe"]) and set(old["methods"]) <= set(new["methods"])
            and all(b in new["budgets"] for b in old["budgets"]) and new["scorers"][:len(old["scorers"])] == old["scorers"])
