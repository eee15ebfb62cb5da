"""The predictability study's summary (:mod:`studies.realbench.predictability`): each figure's mean and 95% bootstrap
interval over traces, per kind of state and budget, and the markdown table of it."""

from __future__ import annotations

from foresight.evaluation.report import bootstrap_ci

FIGURES = ("agreement", "ceiling", "ceiling_half", "mean_future", "scorer")


def summary(rows: list[dict]) -> dict:
    """Mean and 95% bootstrap interval over traces of each figure, per kind of state and budget."""
    out: dict = {}
    for kind, budget in sorted({(r["states"], r["budget"]) for r in rows}):
        mine = [r for r in rows if (r["states"], r["budget"]) == (kind, budget)]
        s = out.setdefault(kind, {})[budget] = {"traces": len(mine)}
        for name in FIGURES:
            vals = [r[name] for r in mine if r.get(name) is not None]
            if vals:
                s[name], s[f"{name}_ci"] = round(sum(vals) / len(vals), 4), bootstrap_ci(vals)
        s["per_layer"] = {name: [round(sum(x) / len(mine), 4) for x in zip(*(r["per_layer"][name] for r in mine))]
                          for name in FIGURES if all(name in r["per_layer"] for r in mine)}
    return out


STATES = {"golden": "golden's trajectory", "scorer": "the scorer's own trajectory"}


def predictability_table(summ: dict, continuations: int) -> str:
    """The summary as a markdown table."""
    head = ("| states | B:L | traces | two futures agree | ceiling, K/2 | ceiling, K | lowest mean future | scorer |\n"
            "|---|---|---|---|---|---|---|---|\n")

    def cell(s, name):
        return f"{s[name]:.3f} [{s[f'{name}_ci'][0]:.3f}, {s[f'{name}_ci'][1]:.3f}]" if name in s else "—"

    lines = [f"| {STATES[kind]} | {b} | {s['traces']} | " + " | ".join(cell(s, n) for n in (
        "agreement", "ceiling_half", "ceiling", "mean_future", "scorer")) + " |"
        for kind, per_budget in summ.items() for b, s in per_budget.items()]
    return head + "\n".join(lines) + f"\n\nK = {continuations} continuations per reference; recall@L against golden " \
        "under the reference's own future at the same state; 95% bootstrap over traces.\n"
