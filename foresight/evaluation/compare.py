"""``foresight compare``: is one method better than another on the same held-out traces?

Two evaluations' rows (or two rows of one evaluation) at each shared budget, compared metric by metric with a
*paired* bootstrap over the held-out traces (:mod:`foresight.evaluation.paired`): the difference candidate − base with its 95%
interval, and a verdict — ``better``/``worse`` when the interval excludes 0, else ``not separated``. Lower is better
for the loss ratio and the loss increases, higher for accuracy. This is the comparison to quote for "GRPO beats SFT"
or "the learned scorer beats H2O": each method's own interval includes the spread of trace difficulty, which the
pairing cancels. Evaluations on a traces folder's validation traces (``eval.traces``) compare among themselves,
never with held-out ones.

    foresight compare runs/eval-sft runs/eval-grpo                       # each folder's one evaluated method
    foresight compare runs/eval --base-method h2o --method foresight-sft  # two rows of one evaluation
"""

from __future__ import annotations

import json
from pathlib import Path

from foresight.evaluation.paired import paired_diff_ci
from foresight.evaluation.report import match_traces

# (name in the table, lower is better)
METRICS = {"loss_ratio": ("loss ratio", True), "low_entropy_loss_increase": ("low-entropy Δloss", True),
           "high_entropy_loss_increase": ("high-entropy Δloss", True), "accuracy": ("accuracy", False)}


def load_rows(path: Path) -> list[dict]:
    """The rows of an evaluation folder (its ``results.json``) or of a ``results.json`` file."""
    path = Path(path)
    f = path / "results.json" if path.is_dir() else path
    if not f.is_file():
        raise FileNotFoundError(f"{path}: no results.json (an output folder of `foresight eval`)")
    try:
        rows = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not a results file of `foresight eval` ({e})") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and "method" in r for r in rows):
        raise ValueError(f"{f}: no evaluated rows (is it a results file of `foresight eval`?)")
    return rows


def pick_method(rows: list[dict], method: str | None, where: Path) -> str:
    """``method`` if the rows have it, else the rows' only method other than the full cache."""
    names = list(dict.fromkeys(r["method"] for r in rows))
    if method is not None:
        if method not in names:
            raise ValueError(f"{where}: no rows of method {method!r} (it has {', '.join(names)})")
        return method
    others = [n for n in names if n != "full"]
    if len(others) != 1:
        raise ValueError(f"{where} has the methods {', '.join(names)}: say which with --base-method / --method")
    return others[0]


def _per_trace_metric(row: dict, key: str):
    """(numerators, denominators) per held-out trace for a ratio-of-sums metric; None when the row lacks them."""
    pt = row.get("per_trace") or {}
    if key == "loss_ratio":
        return (pt["evicted_loss"], pt["full_loss"]) if pt.get("evicted_loss") else None
    part = pt.get(key.replace("_loss_increase", ""))  # low_entropy / high_entropy: [sum of increases, tokens]
    return ([v for v, _ in part], [c for _, c in part]) if part else None


def _solved(row: dict) -> list[float] | None:
    """Per problem, the share of samples that solved it (greedy evaluations before 2026-12: the divergence record)."""
    if row.get("per_problem_solved") is not None:
        return row["per_problem_solved"]
    div = row.get("divergence") or {}
    return [float(p["correct"]) for p in div["per_problem"]] if div.get("per_problem") else None


def compare_rows(base: dict, cand: dict, seed: int = 0) -> dict:
    """Per metric: base's and candidate's values, the paired difference candidate − base with its 95% interval, and
    the verdict. Raises when the two rows were not evaluated on the same held-out traces."""
    pairs = match_traces(base.get("per_trace") or {"evicted_loss": [], "full_loss": []},
                         cand.get("per_trace") or {"evicted_loss": [], "full_loss": []})
    if pairs is None or any(abs(base["per_trace"]["full_loss"][i] - cand["per_trace"]["full_loss"][j]) >
                            1e-4 * max(1.0, abs(base["per_trace"]["full_loss"][i])) for i, j in pairs):
        raise ValueError(f"{base['method']} and {cand['method']} at B={base['budget']} were not evaluated on the same "
                         "held-out traces (evaluate both with the same recipe's eval settings, or one evaluation)")
    out = {}
    for key, (label, lower_better) in METRICS.items():
        if key == "accuracy":
            a, b = _solved(base), _solved(cand)
            if a is None or b is None or len(a) != len(b):
                continue
            ci = paired_diff_ci(a, None, b, None, seed)
            va, vb = sum(a) / len(a), sum(b) / len(b)
        else:
            ma, mb = _per_trace_metric(base, key), _per_trace_metric(cand, key)
            if ma is None or mb is None:
                continue
            na, da = ([x[i] for i, _ in pairs] for x in ma)
            nb, db = ([x[j] for _, j in pairs] for x in mb)
            ci = paired_diff_ci(na, da, nb, db, seed)
            va, vb = sum(na) / max(sum(da), 1e-12), sum(nb) / max(sum(db), 1e-12)
        better = ci is not None and ((ci[1] < 0) if lower_better else (ci[0] > 0))
        worse = ci is not None and ((ci[0] > 0) if lower_better else (ci[1] < 0))
        out[key] = {"base": round(va, 5), "candidate": round(vb, 5), "diff": round(vb - va, 5), "diff_ci": ci,
                    "verdict": "better" if better else "worse" if worse else "not separated"}
    return out


def compare(base_path: Path, cand_path: Path, base_method: str | None = None, method: str | None = None,
            seed: int = 0) -> dict:
    """Every budget both evaluations hold, for the chosen method of each (see the module docstring)."""
    rows_a, rows_b = load_rows(base_path), load_rows(cand_path)
    ma, mb = pick_method(rows_a, base_method, base_path), pick_method(rows_b, method, cand_path)
    if (Path(base_path), ma) == (Path(cand_path), mb):
        raise ValueError(f"comparing {ma} in {base_path} with itself: name another method or evaluation")
    ta, tb = references_of(base_path), references_of(cand_path)
    if _resolved(ta) != _resolved(tb):  # both number their traces from 0: nothing in the rows would tell them apart
        raise ValueError(f"{base_path} ran on {ta} traces and {cand_path} on {tb}: not the same traces")
    by_a = {(r["budget"], r["interval"]): r for r in rows_a if r["method"] == ma}
    by_b = {(r["budget"], r["interval"]): r for r in rows_b if r["method"] == mb}
    shared = sorted(set(by_a) & set(by_b))
    if not shared:
        raise ValueError(f"{ma} in {base_path} (B:L {sorted(by_a)}) and {mb} in {cand_path} (B:L {sorted(by_b)}) "
                         "share no budget")
    return {"base": {"path": str(base_path), "method": ma}, "candidate": {"path": str(cand_path), "method": mb},
            "traces": ta,
            "rows": [{"budget": B, "interval": L, "num_problems": by_a[(B, L)].get("num_problems"),
                      "metrics": compare_rows(by_a[(B, L)], by_b[(B, L)], seed)} for B, L in shared]}


def references_of(path: Path) -> str:
    """Which traces an evaluation ran on, from the ``meta.json`` beside its results: ``held-out`` (the default, and
    for evaluations from before ``eval.traces``) or ``validation traces of DIR``."""
    p = Path(path)
    meta = (p if p.is_dir() else p.parent) / "meta.json"
    try:
        return json.loads(meta.read_text()).get("references", "held-out")
    except (OSError, ValueError, AttributeError):
        return "held-out"


def _resolved(references: str) -> str:
    """``validation traces of DIR`` with DIR made absolute (from the working directory: older evaluations stored the
    path as given), so one folder named two ways is one set of traces."""
    head = "validation traces of "
    return head + str(Path(references[len(head):]).resolve()) if references.startswith(head) else references


def compare_table(result: dict) -> str:
    """Markdown: one line per (budget, metric)."""
    a, b = result["base"]["method"], result["candidate"]["method"]
    traces = result.get("traces", "held-out")
    traces = "held-out traces" if traces == "held-out" else traces
    lines = [f"Paired comparison on the same {traces}: candidate {b} ({result['candidate']['path']}) − base {a} "
             f"({result['base']['path']}); 95% paired-bootstrap intervals.\n",
             "| B:L | metric | base | candidate | candidate − base [95% CI] | verdict |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        for key, m in r["metrics"].items():
            ci = "—" if m["diff_ci"] is None else f"[{m['diff_ci'][0]:+.4g}, {m['diff_ci'][1]:+.4g}]"
            lines.append(f"| {r['budget']}:{r['interval']} | {METRICS[key][0]} | {m['base']:.4g} | {m['candidate']:.4g} | "
                         f"{m['diff']:+.4g} {ci} | {m['verdict']} |")
    return "\n".join(lines) + "\n"
