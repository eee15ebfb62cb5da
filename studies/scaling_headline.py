"""The data-scaling study's headline check (:mod:`studies.data_scaling`, stage ``headline``): the paper's claim, the
learned scorer at B at or below the best heuristic at 2B, at the study's best measured point.

* the best point: the study's run (any size, the steps' control or the wider scorer) with the lowest mean held-out
  loss ratio over the study's budgets. It is chosen on the same references it is then reported on, which the report says;
* uniform budgets: the heuristics and that scorer at twice the largest budget as well (``OUT/headline-<2B>``: 512
  for the study's 128 and 256), so the scorer is paired against every heuristic at 128, 256 and 512;
* an allocation (``Scaling.allocation``; by default the one ``foresight heads`` recommends for SmolLM2-135M: layers
  15-24 at twice the share, layer 18's KV head 2 whole, the prompt protected on top as random-keep-prompt holds it)
  at the budgets that hold the memory of the uniform ones (``Scaling.allocated``: B' = 114 / 242 for 128 / 256, the
  whole head's store counted, docs/results/smollm2-135m/whole-heads/), for the best point, the largest size and the
  reference size's scorer (``OUT/headline-alloc-<run>``): its row at B' against the best heuristic's uniform row at 2B.
"""

from __future__ import annotations

import json
from pathlib import Path

from foresight.config.recipe import parse_budgets
from studies.realbench.goals import paired_ci
from studies.realbench.run import banner, trained

ALLOCATION = ("cache.layer_budgets=15-24:2", "cache.whole_heads=18:2", "eval.protect_prompt=true",
              "cache.prompt_overflow=evict")
ALLOCATED = "114,242"  # B' for each of the study's budgets (128, 256): at most their memory, head 18:2's store counted


def budgets(study) -> list[tuple[int, int]]:
    return parse_budgets(study.budgets)


def top(study) -> int:
    """Twice the study's largest budget: the heuristics' 2B there."""
    return 2 * max(b for b, _ in budgets(study))


def allocated(study) -> dict[int, int]:
    """{uniform B: B' of the allocation}."""
    alloc = [int(x) for x in study.allocated.split(",")]
    if len(alloc) != len(budgets(study)):
        raise ValueError(f"allocated={study.allocated}: one B' for each of the budgets {study.budgets}")
    return {b: a for (b, _), a in zip(budgets(study), alloc)}


def result_rows(folder: Path) -> list[dict]:
    """An evaluation folder's rows (none before it ran)."""
    f = folder / "results.json"
    return json.loads(f.read_text()) if f.exists() else []


def _scorer_rows(folder: Path) -> dict[int, dict]:
    return {r["budget"]: r for r in result_rows(folder) if r["method"] != "full"}


def best_run(study) -> str | None:
    """The run (any size, the steps' control or the wider scorer) with the lowest mean held-out loss ratio over the
    study's budgets, among those evaluated at every one of them."""
    bs = [b for b, _ in budgets(study)]
    means = {}
    for name, _, _ in study.runs():
        rows = _scorer_rows(study.out / f"eval-{name}")
        if all(b in rows and rows[b].get("loss_ratio") is not None for b in bs):
            means[name] = sum(rows[b]["loss_ratio"] for b in bs) / len(bs)
    return min(means, key=means.get) if means else None


def allocated_runs(study, best: str) -> list[str]:
    """The runs evaluated with the allocation: the best point, the largest size and the reference size's."""
    names = [best, f"sft-{max(study.sizes)}", f"sft-{study.reference}"]
    return [n for i, n in enumerate(names) if n not in names[:i] and trained(study.out / n)]


def run_headline(study) -> None:
    from foresight.evaluation.evaluate import run_eval

    best = best_run(study)
    if best is None:
        raise ValueError("the headline check needs every run evaluated at every budget: run the eval stage first")
    hi, interval = top(study), max(budgets(study))[1]
    banner(f"headline: {best} and the heuristics at {hi}")
    heuristics = ",".join(m for m in study.methods.split(",") if m != "golden")  # golden at 2B: not the comparison
    run_eval(study.recipe("eval.recall=false"), study.out / f"headline-{hi}", methods=heuristics,
             budgets=f"{hi}:{interval}", scorers=[study.out / best])
    alloc = allocated(study)
    at = ",".join(f"{alloc[b]}:{k}" for b, k in budgets(study))
    for name in allocated_runs(study, best):
        banner(f"headline: {name} with the allocation at {at}")
        run_eval(study.recipe("eval.recall=false", *study.allocation), study.out / f"headline-alloc-{name}",
                 methods="full", budgets=at, scorers=[study.out / name])


def _verdict(ci) -> str:
    if not ci:
        return "no interval"
    return "below" if ci[1] < 0 else "above" if ci[0] > 0 else "tie"


def _pair(a: dict, b: dict) -> str:
    ci = paired_ci(a, b)
    d = a["loss_ratio"] - b["loss_ratio"]
    return f"{d:+.4f}" + (f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "") + f" ({_verdict(ci)})"


def interval(row: dict) -> str:
    """A row's loss ratio with its 95% interval."""
    ci = row.get("loss_ratio_ci")
    return f"{row['loss_ratio']:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")


def heuristic_rows(study) -> dict[int, dict[str, dict]]:
    """{B: {heuristic: row}} at the study's budgets and at twice the largest (no full, no golden, no scorer)."""
    out: dict[int, dict[str, dict]] = {}
    for folder in (study.out / "eval-methods", study.out / f"headline-{top(study)}"):
        for r in result_rows(folder):
            if r["method"] not in ("full", "golden") and not r["method"].startswith("foresight"):
                out.setdefault(r["budget"], {})[r["method"]] = r
    return out


def headline_rows(study) -> dict:
    """The rows the section reads: the best point, the uniform rows at 2B and each allocated run's rows."""
    best = best_run(study)
    if best is None:
        return {}
    return {"best": best, f"uniform_{top(study)}": result_rows(study.out / f"headline-{top(study)}"),
            "allocation": list(study.allocation), "allocated": allocated(study),
            "allocated_runs": {n: result_rows(study.out / f"headline-alloc-{n}") for n in allocated_runs(study, best)}}


def headline_lines(study) -> list[str]:
    """The report's section (empty before the stage ran)."""
    best = best_run(study)
    at_top = _scorer_rows(study.out / f"headline-{top(study)}")
    if best is None or not at_top:
        return []
    heur, alloc = heuristic_rows(study), allocated(study)
    uniform = _scorer_rows(study.out / f"eval-{best}") | at_top
    lines = [f"## The 2B headline at the best point: {best}", "",
             f"{best} has the lowest mean loss ratio over {study.budgets} on these references (chosen on them, so its "
             "margin over the other sizes is optimistic). Paired differences: the scorer − the other row on the same "
             "traces, 95% bootstrap interval; *below* when the interval lies below 0.", "",
             "### Uniform budgets: the scorer against every heuristic", "",
             "| B | the scorer [95%] | heuristic | its loss ratio | scorer − heuristic (paired) |", "|---:|---|---|---|---|"]
    for b in sorted(uniform):
        for m, r in sorted(heur.get(b, {}).items(), key=lambda kv: kv[1]["loss_ratio"]):
            lines.append(f"| {b} | {interval(uniform[b])} | {m} | {interval(r)} | {_pair(uniform[b], r)} |")
    lines += ["", f"### With the allocation ({', '.join(study.allocation)}) at the memory of B, against the best heuristic "
              "at 2B (uniform)", "",
              "| run | B' (memory of B) | loss ratio [95%] · mean cache | best heuristic at 2B · mean cache | − it (paired) "
              "| − the run at uniform B (paired) |", "|---|---:|---|---|---|---|"]
    for name in allocated_runs(study, best):
        rows, plain = _scorer_rows(study.out / f"headline-alloc-{name}"), _scorer_rows(study.out / f"eval-{name}")
        for b, b_alloc in alloc.items():
            row, at2b = rows.get(b_alloc), heur.get(2 * b, {})
            if row is None or not at2b:
                continue
            h = min(at2b.values(), key=lambda r: r["loss_ratio"])
            vs_plain = _pair(row, plain[b]) if b in plain else "—"
            lines.append(f"| {name} | {b_alloc} ({b}) | {interval(row)} · {row.get('mean_cache', '—')} | "
                         f"{h['method']} at {2 * b}: {interval(h)} · {h.get('mean_cache', '—')} | {_pair(row, h)} | "
                         f"{vs_plain} |")
    return lines + [""]
