"""The real-model benchmark's goal checks, computed from evaluation rows, not claimed: at each budget,
whether the best learned scorer's loss-ratio interval lies below every heuristic's (and by a paired interval on the
same traces); whether it is at or below the best heuristic's at twice the budget; its recall@L; whether GRPO's
low-entropy loss increase lies below SFT's with separated intervals."""

from __future__ import annotations

from foresight.evaluation.report import paired_ratio_diff_ci
from foresight.evaluation.styles import method_group


def _below(a: dict, b: dict, key: str) -> bool:
    """a's 95% interval of ``key`` lies entirely below b's."""
    ca, cb = a.get(f"{key}_ci"), b.get(f"{key}_ci")
    return bool(ca and cb and ca[1] < cb[0])


def paired_ci(a: dict, b: dict) -> list[float] | None:
    """The paired 95% interval of loss ratio(a) − loss ratio(b) on the traces both rows hold; None without them."""
    return paired_ratio_diff_ci(a["per_trace"], b["per_trace"]) if a.get("per_trace") and b.get("per_trace") else None


def _paired_below(a: dict, b: dict) -> bool:
    """a's loss ratio is below b's on the same traces: the paired 95% interval of the difference lies below 0."""
    ci = paired_ci(a, b)
    return bool(ci and ci[1] < 0)


def _holds_more(a: dict, b: dict) -> bool:
    """a's mean cache is more than 1% larger than b's."""
    return (a.get("mean_cache") or 0) > 1.01 * (b.get("mean_cache") or 0)


def goal_checks(rows: list[dict]) -> list[dict]:
    """Per budget: the best learned scorer (lowest loss ratio) against every heuristic, and against the best heuristic
    at twice the budget."""
    out = []
    budgets = sorted({(r["budget"], r["interval"]) for r in rows})
    for B, L in budgets:
        at = [r for r in rows if (r["budget"], r["interval"]) == (B, L)]
        learned = [r for r in at if method_group(r["method"]) == "learned"]
        heur = [r for r in at if method_group(r["method"]) == "heuristic"]
        if not learned or not heur:
            continue
        best = min(learned, key=lambda r: r["loss_ratio"])
        best_h = min(heur, key=lambda r: r["loss_ratio"])
        twice = [r for r in rows if r["budget"] == 2 * B and method_group(r["method"]) == "heuristic"]
        best_2b = min(twice, key=lambda r: r["loss_ratio"]) if twice else None
        out.append({"budget": B, "interval": L, "best_learned": best["method"], "loss_ratio": best["loss_ratio"],
                    "best_heuristic": best_h["method"], "best_heuristic_loss_ratio": best_h["loss_ratio"],
                    "below_every_heuristic": all(best["loss_ratio"] < h["loss_ratio"] for h in heur),
                    "separated_from_every_heuristic": all(_below(best, h, "loss_ratio") for h in heur),
                    "heuristics_not_separated": [h["method"] for h in heur if not _below(best, h, "loss_ratio")],
                    # e.g. random-keep-prompt keeps the whole prompt on top of B: more memory than the learned scorer
                    "heuristics_holding_more": [h["method"] for h in heur if _holds_more(h, best)],
                    "separated_at_equal_memory": all(_below(best, h, "loss_ratio") for h in heur if not _holds_more(h, best)),
                    # the same comparison on the same traces (paired bootstrap of the difference)
                    "heuristics_not_below_paired": [h["method"] for h in heur if not _paired_below(best, h)],
                    "best_heuristic_at_2B": best_2b and best_2b["method"],
                    "at_or_below_best_heuristic_at_2B": None if best_2b is None else
                    best["loss_ratio"] <= best_2b["loss_ratio"],
                    "recall_at_L": best.get("recall_at_L"), "recall_at_L_ci": best.get("recall_at_L_ci"),
                    "keep_recall": best.get("keep_recall"), "keep_recall_ci": best.get("keep_recall_ci")})
    return out


def grpo_vs_sft(rows: list[dict]) -> list[dict]:
    out = []
    for B in sorted({r["budget"] for r in rows}):
        sft = next((r for r in rows if r["budget"] == B and r["method"] == "foresight-sft"), None)
        grpo = next((r for r in rows if r["budget"] == B and r["method"] == "foresight-grpo"), None)
        if sft and grpo:
            out.append({"budget": B, "sft": sft["low_entropy_loss_increase"], "sft_ci": sft["low_entropy_loss_increase_ci"],
                        "grpo": grpo["low_entropy_loss_increase"], "grpo_ci": grpo["low_entropy_loss_increase_ci"],
                        "grpo_below_with_separated_intervals": _below(grpo, sft, "low_entropy_loss_increase")})
    return out
