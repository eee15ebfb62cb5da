"""Evaluation results as text: bootstrap intervals over held-out traces, the markdown table and the one-line-per-budget
summary."""

from __future__ import annotations

from foresight.evaluation.paired import aligned, paired_diff_ci, percentile_interval, resampled_stat, resamples
from foresight.evaluation.styles import RESOLUTION, budgets, describe, method_group, pct, series_label


def bootstrap_ci(num: list[float], den: list[float] | None = None, seed: int = 0) -> list[float] | None:
    """95% percentile interval of Σnum/Σden (a ratio of sums, e.g. the loss ratio) or of mean(num) when ``den`` is
    None, resampling the traces with replacement (seeded: the same values give the same interval)."""
    if not num:
        return None
    return percentile_interval(resampled_stat(num, den, resamples(len(num), seed)))


def paired_ratio_diff_ci(a: dict, b: dict, seed: int = 0) -> list[float] | None:
    """95% interval of loss ratio(a) − loss ratio(b) resampling the *same* held-out traces for both (a paired
    bootstrap, :mod:`foresight.evaluation.paired`). ``a``, ``b``: the ``per_trace`` dicts of two rows (``evicted_loss``,
    ``full_loss`` and, from evaluations since 2026-12, ``trace``: the held-out trace of each entry). Traces are matched
    by ``trace`` when both rows have it (batching may order them differently), else by position when the full-cache
    losses are the same list, else by their full-cache loss; None when the two rows do not hold the same traces or
    cannot be matched."""
    pairs = match_traces(a, b)
    if pairs is None:
        return None
    ia, ib = ([p[k] for p in pairs] for k in (0, 1))
    full = [a["full_loss"][i] for i in ia]
    return paired_diff_ci([b["evicted_loss"][j] for j in ib], full, [a["evicted_loss"][i] for i in ia], full, seed)


def match_traces(a: dict, b: dict) -> list[tuple[int, int]] | None:
    """Index pairs of the same held-out trace in two rows' ``per_trace`` dicts (see :func:`paired_ratio_diff_ci`)."""
    if a.get("trace") is not None and b.get("trace") is not None:
        ka, kb = a["trace"], b["trace"]
    elif a["full_loss"] == b["full_loss"]:  # the same traces in the same order
        ka = kb = list(range(len(a["full_loss"])))
    else:
        ka, kb = ([round(f, 4) for f in p["full_loss"]] for p in (a, b))
    if len(ka) != len(a["evicted_loss"]) or len(kb) != len(b["evicted_loss"]):
        return None
    return aligned(ka, kb)


def _prot(v) -> str:
    return "fallback (prompt > B)" if v == "fallback" else ("yes" if v else "no")


def fmt(v, nd=3) -> str:
    """A table cell: a number to ``nd`` digits (an em dash for None)."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def dloss(v) -> str:
    """A loss increase (nats per token) to 3 significant digits; below results.json's rounding, ``<1e-5``.

    Fixed decimals do not suit it: on the tiny teacher a learned scorer's low-entropy increase is ~1e-3 and a
    heuristic's ~0.1, so 3 decimals printed GRPO's 0.00097 and SFT's 0.0023 both as 0.002 or 0.001.
    """
    if v is None:
        return "—"
    if abs(v) < RESOLUTION:
        return f"<{RESOLUTION:g}".replace("e-0", "e-")
    return f"{v:.5f}" if abs(v) < 1e-4 else f"{v:.3g}"  # 4e-05 -> 0.00004: no exponent at the rounding's last digit


def with_ci(v, ci, nd=3, cell=None) -> str:
    """A table cell: a value and its interval ``[lo, hi]`` when known, each by ``cell`` (default: ``nd`` digits)."""
    one = cell or (lambda x: fmt(x, nd))
    return one(v) + ("" if not ci else f" [{one(ci[0])}, {one(ci[1])}]")


def results_table(rows, meta) -> str:
    head = ("| method | prompt kept | B:L | loss ratio [95% CI] | Δloss low-H | Δloss high-H | accuracy | n | recall@L | "
            "keep recall | cache: mean · peak |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['method']} | {_prot(r['protect_prompt'])} | {r['budget']}:{r['interval']} | "
        f"{with_ci(r['loss_ratio'], r.get('loss_ratio_ci'), 4)} | "
        f"{with_ci(r['low_entropy_loss_increase'], r.get('low_entropy_loss_increase_ci'), cell=dloss)} | "
        f"{with_ci(r['high_entropy_loss_increase'], r.get('high_entropy_loss_increase_ci'), cell=dloss)} | "
        f"{fmt(r['accuracy'])} | {r['n_samples']} | {with_ci(r['recall_at_L'], r.get('recall_at_L_ci'), 3)} | "
        f"{with_ci(r.get('keep_recall'), r.get('keep_recall_ci'), 3)} | "
        f"{fmt(r['mean_cache'], 1)} · {fmt(r.get('peak_cache'), 1)} |\n"
        for r in rows)
    source = meta.get("references", "held-out")
    what = "held-out problems" if source == "held-out" else f"{source} (not the held-out set)"
    info = (f"\n{meta['num_problems']} {what}, mean trace {meta['mean_trace_length']:.0f} tokens "
            f"(prompt {meta['mean_prompt_length']:.0f}); full-cache accuracy of the reference traces: "
            f"{fmt(meta['full_cache_trace_accuracy'])}. Intervals: 95% bootstrap over the traces.\n")
    return head + body + info


# --- the summary ---------------------------------------------------------------------------------------------------


def _best(rows: list[dict]) -> dict | None:
    """Highest accuracy; ties (and rows without accuracy) by the lower low-entropy loss increase."""
    if not rows:
        return None
    return min(rows, key=lambda r: (-(r["accuracy"] if r.get("accuracy") is not None else -1.0),
                                    r.get("low_entropy_loss_increase") or 0.0))


def _who(r: dict | None) -> str:
    if r is None:
        return "—"
    acc = "" if r.get("accuracy") is None else f"accuracy {r['accuracy']:.2f}, "
    return f"{series_label(r)} ({acc}Δloss {dloss(r.get('low_entropy_loss_increase'))})"


def summary_lines(rows: list[dict], meta: dict | None = None) -> list[str]:
    """At each budget, one line: the best learned scorer, the best heuristic and golden (best = highest accuracy,
    then lowest loss increase on low-entropy tokens)."""
    full = [r for r in rows if r["method"] == "full" and r.get("accuracy") is not None]
    head = "summary: " + describe(rows, meta)
    if full:
        head += f"; full cache accuracy {sum(r['accuracy'] for r in full) / len(full):.2f}"
    lines = [head, "  (accuracy: greedy task accuracy; Δloss: mean loss increase per low-entropy token, nats; "
                   "best = highest accuracy, then lowest Δloss)"]
    for B, L in budgets(rows):
        at = [r for r in rows if (r["budget"], r["interval"]) == (B, L)]
        learned = _best([r for r in at if method_group(r["method"]) == "learned"])
        heur = _best([r for r in at if method_group(r["method"]) == "heuristic"])
        golden = next((r for r in at if r["method"] == "golden"), None)
        lines.append(f"  B={B}:{L}{pct(B, meta)}: best learned {_who(learned)} | best heuristic {_who(heur)} | "
                     f"golden Δloss {dloss(golden and golden.get('low_entropy_loss_increase'))}")
    return lines
