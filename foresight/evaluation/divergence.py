"""Where greedy generation under eviction first leaves the full-cache reference, and what that token cost.

With greedy decoding the full-cache reference of a problem is the text the model writes without eviction. Generation
under a method writes the same tokens until an eviction changes an argmax; from there it writes something else (and
usually fails the task if the token mattered). Up to that token its cache held exactly what the method's
teacher-forced rollout along the reference holds, so the rollout's per-token loss *at* the first divergent token is
the price of the eviction that caused it (at least ln 2: the reference token is no longer the most likely). A large
increase on a token the full cache was sure of (entropy ~0: a value looked up in the prompt) marks one catastrophic
eviction, which a mean loss increase hides; a small one marks drift between near-tied tokens. ``foresight eval``
reports this per (method, budget) when decoding is greedy.
"""

from __future__ import annotations

import statistics


def first_divergence(reference: list[int], generated: list[int]) -> int | None:
    """Index of the first new token where ``generated`` differs from ``reference`` (both without the prompt);
    None when they are equal. A text that stops early (or runs on) diverges where the shorter one ends."""
    for j, (a, b) in enumerate(zip(reference, generated)):
        if a != b:
            return j
    return None if len(reference) == len(generated) else min(len(reference), len(generated))


class DivergenceStats:
    """Per problem of one (method, budget) row: the first divergence and the teacher-forced loss there."""

    def __init__(self):
        self.items: list[dict] = []

    def add(self, problem: int, position: int | None, prompt_len: int, loss, full_loss, full_entropy,
            correct: bool) -> None:
        """``position``: new-token index of the first divergence (None: none); ``loss`` [S]: the method's teacher-
        forced per-token loss along the reference; ``full_loss``, ``full_entropy`` [S]: the full cache's."""
        item = {"problem": problem, "position": position, "correct": bool(correct)}
        t = None if position is None else prompt_len + position
        if t is not None and t < len(full_loss):  # a divergence past the reference's end (generation ran on) has no loss
            item |= {"loss": round(float(loss[t]), 4), "loss_increase": round(float(loss[t] - full_loss[t]), 4),
                     "entropy": round(float(full_entropy[t]), 4),
                     "loss_increase_before": round(float((loss[prompt_len:t] - full_loss[prompt_len:t]).abs().max()), 4)
                     if t > prompt_len else 0.0}
        self.items.append(item)

    def row(self) -> dict:
        """The row's summary: the share of problems that diverge, and medians over those that do."""
        div = [i for i in self.items if i["position"] is not None]
        scored = [i for i in div if "loss_increase" in i]

        def median(key, among):
            return round(statistics.median(i[key] for i in among), 4) if among else None

        return {"diverged": round(len(div) / len(self.items), 4) if self.items else None,
                "position_median": median("position", div),
                "loss_increase_median": median("loss_increase", scored),
                "entropy_median": median("entropy", scored),
                "per_problem": self.items}


def divergence_table(rows: list[dict]) -> str:
    """Markdown: per (method, budget) with a divergence record, where greedy generation left the reference."""
    have = [r for r in rows if r.get("divergence")]
    if not have:
        return ""
    head = ("\nFirst divergence of greedy generation under eviction from the full-cache reference (medians over the "
            "problems that diverge; Δloss and entropy: the teacher-forced loss increase and the full cache's entropy "
            "at that token):\n\n| method | B:L | diverged | position | Δloss there | entropy there |\n"
            "|---|---|---|---|---|---|\n")

    def f(v, nd=3):
        return "—" if v is None else f"{v:.{nd}g}"

    return head + "".join(
        f"| {r['method']} | {r['budget']}:{r['interval']} | {f(d['diverged'], 2)} | {f(d['position_median'], 5)} | "
        f"{f(d['loss_increase_median'])} | {f(d['entropy_median'])} |\n" for r in have for d in [r["divergence"]])
