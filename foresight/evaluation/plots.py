"""Figures for the evaluation — metric-vs-budget curves, the demo's headline figure, a one-line-per-budget summary —
and an eviction map (which tokens each head kept).

Every method has one fixed style in every figure (:func:`method_style`): the learned scorers in saturated colours
and thick lines, the heuristics in one muted family told apart by their markers, golden, kvpop-oracle and the full
cache as black/grey reference lines. Axes whose values span more than two decades are logarithmic.

    python -m foresight.evaluation.plots --results runs/tiny-qwen3/eval                          # redraw the figures there
    python -m foresight.evaluation.plots --results runs/tiny-qwen3/eval --headline docs/demo.png  # the README's figure
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.transforms import offset_copy  # noqa: E402

from foresight.evaluation.report import summary_lines  # noqa: E402
from foresight.evaluation.styles import (METRICS, RESOLUTION, choose_scale, describe, method_group, method_style,  # noqa: E402
                              )
from foresight.evaluation.styles import budgets as _budgets  # noqa: E402
from foresight.evaluation.styles import pct as _pct  # noqa: E402
from foresight.evaluation.styles import series as _series  # noqa: E402
from foresight.evaluation.styles import style_of as _style  # noqa: E402

def _panel(ax, series: dict, metric: str, meta: dict | None) -> None:
    ci_key, title, better = METRICS[metric]
    drawn = {}
    for label, pts in series.items():
        pts = [r for r in pts if r.get(metric) is not None]
        if not pts:
            continue
        if pts[0]["method"] == "full":  # independent of the budget: one reference line
            if metric in ("accuracy", "loss_ratio"):  # (its loss increase is 0 by definition)
                v = sum(r[metric] for r in pts) / len(pts)
                ax.axhline(v, **{k: x for k, x in method_style("full").items() if k not in ("marker", "markersize")})
                ax.annotate(f"full cache {v:.2f}" if metric == "accuracy" else "full cache", (0.0, v),
                            xycoords=("axes fraction", "data"), xytext=(3, 3), textcoords="offset points",
                            ha="left", va="bottom", fontsize=7, annotation_clip=True)
            continue
        drawn[label] = pts
    values = [r[metric] for pts in drawn.values() for r in pts]
    shown = values + ([1.0] if metric == "loss_ratio" else [])  # the full cache's ratio of 1 stays in view
    scale = "linear" if metric == "accuracy" else choose_scale(shown)
    ax.set_yscale(scale)
    pos = [v for v in shown if v > 0]
    floor = 10 ** math.floor(math.log10(min(pos))) if scale == "log" and pos else None
    clipped = floor is not None and any(v <= 0 for v in values)
    if clipped:
        floor = min(floor, RESOLUTION)  # a 0 is "below the rounding", not "at the smallest value shown"

    def lift(vs):
        return vs if floor is None else [max(v, floor) for v in vs]

    learned = [label for label, pts in drawn.items() if method_group(pts[0]["method"]) == "learned"]
    for label, pts in drawn.items():
        style = _style(pts)
        transform = ax.transData
        if label in learned and len(learned) > 1:  # learned curves that coincide stay visible side by side
            dx = (learned.index(label) - (len(learned) - 1) / 2) * 3.5
            transform = offset_copy(ax.transData, fig=ax.figure, x=dx, y=0, units="points")
        xs = [r["budget"] for r in pts]
        ax.plot(xs, lift([r[metric] for r in pts]), label=label, transform=transform, **style)
        cis = [r.get(ci_key) if ci_key else None for r in pts]
        if len(xs) > 1 and all(c is not None for c in cis):
            alpha = 0.16 if label in learned else 0.06
            ax.fill_between(xs, lift([c[0] for c in cis]), lift([c[1] for c in cis]), color=style["color"],
                            alpha=alpha, linewidth=0, zorder=style["zorder"] - 1, transform=transform)
    if metric == "accuracy":
        ax.set_ylim(-0.03, 1.05)
    if floor is not None:
        ax.set_ylim(bottom=floor / 1.5)
    note = better + ("; full cache = 0" if "increase" in metric else "") + \
        ("; bands: 95% CI over traces" if ci_key and any(r.get(ci_key) for pts in drawn.values() for r in pts) else "")
    ax.set_title(f"{title}\n{note}", fontsize=9)
    ylabel = {"accuracy": "fraction of problems solved", "loss_ratio": "ratio"}.get(metric, "nats per token")
    if clipped:
        ylabel += f"\n(≤ 0, below the 1e{round(math.log10(RESOLUTION))} rounding: drawn at the floor)"
    ax.set_ylabel(ylabel, fontsize=8)
    budgets = _budgets([r for pts in series.values() for r in pts])
    bs = [B for B, _ in budgets]
    if bs and max(bs) / max(min(bs), 1) >= 8:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    elif bs:
        pad = 0.08 * (max(bs) - min(bs) or max(bs))
        ax.set_xlim(min(bs) - pad, max(bs) + pad)
    ax.set_xticks(bs, [f"{B}:{L}\n{_pct(B, meta).strip(' ()')}" for B, L in budgets], fontsize=8)
    ax.set_xlabel("budget B:L (pairs kept per KV head; % of the mean trace)", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(alpha=0.3, which="major")


def _legend(fig, series: dict) -> None:
    handles, labels, group = [], [], None
    heads = {"learned": "learned scorers", "reference": "references", "heuristic": "heuristics"}
    for label, pts in series.items():
        g = method_group(pts[0]["method"])
        if g != group:
            handles.append(Line2D([], [], linestyle="none", marker=""))
            labels.append(heads[g])
            group = g
        style = _style(pts)
        if pts[0]["method"] == "full":
            style = {k: v for k, v in style.items() if k not in ("marker", "markersize")}
        handles.append(Line2D([], [], **style))
        labels.append(label)
    leg = fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False,
                     handlelength=3.2)
    for text, label in zip(leg.get_texts(), labels):
        if label in heads.values():
            text.set_fontweight("bold")


def metric_figure(rows: list[dict], metrics: list[str], meta: dict | None = None, title: str | None = None):
    """One panel per metric against the budget, a shared legend outside the axes, and what the figure shows on top."""
    series = _series(rows)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics) + 0.6, 4.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        _panel(ax, series, metric, meta)
    _legend(fig, {k: v for k, v in series.items() if any(r.get(m) is not None for r in v for m in metrics)})
    fig.suptitle((title + "\n" if title else "") + describe(rows, meta, " — " if len(metrics) > 1 else "\n"),
                 fontsize=9.5)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _shrink(path: Path) -> None:
    """A committed PNG: 256 colours (the figure has few), a third of the size."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


HEADLINE = ["accuracy", "low_entropy_loss_increase", "high_entropy_loss_increase"]


def headline_figure(rows: list[dict], meta: dict | None = None):
    """The demo's figure: accuracy and the per-token loss increase (low- and high-entropy tokens) against the budget."""
    return metric_figure(rows, HEADLINE, meta, "KV-cache eviction: learned scorers vs heuristics")


def read_meta(out: Path) -> dict | None:
    """OUT/meta.json of an evaluation, or None."""
    f = Path(out) / "meta.json"
    return json.loads(f.read_text()) if f.exists() else None


def budget_curves(rows: list[dict], out: Path, meta: dict | None = None) -> None:
    """OUT/accuracy.png, loss_ratio.png, loss_increase.png and overview.png (the headline figure); ``meta`` (or
    OUT/meta.json) says which model and traces."""
    out = Path(out)
    meta = meta if meta is not None else read_meta(out)
    _save(metric_figure(rows, ["accuracy"], meta), out / "accuracy.png")
    _save(metric_figure(rows, ["loss_ratio"], meta), out / "loss_ratio.png")
    _save(metric_figure(rows, ["low_entropy_loss_increase", "high_entropy_loss_increase"], meta),
          out / "loss_increase.png")
    _save(headline_figure(rows, meta), out / "overview.png")


# --- python -m foresight.evaluation.plots -------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, required=True, help="an eval output folder (results.json, meta.json)")
    ap.add_argument("--out", type=Path, default=None, help="redraw every figure here (default: --results, "
                                                            "unless --headline is given)")
    ap.add_argument("--headline", type=Path, default=None,
                    help="write only the headline figure to this PNG, and its summary lines next to it (.txt)")
    a = ap.parse_args(argv)
    rows = json.loads((a.results / "results.json").read_text())
    meta = read_meta(a.results)
    if a.out is not None or a.headline is None:
        out = a.out or a.results
        out.mkdir(parents=True, exist_ok=True)
        budget_curves(rows, out, meta)
        print(f"figures in {out}")
    lines = summary_lines(rows, meta)
    if a.headline is not None:
        a.headline.parent.mkdir(parents=True, exist_ok=True)
        _save(headline_figure(rows, meta), a.headline)
        _shrink(a.headline)
        a.headline.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        print(f"headline figure {a.headline}, summary {a.headline.with_suffix('.txt')}")
    print("\n".join(lines))
    return 0


def eviction_map(model, ref: dict, method, B: int, L: int, future, path: Path) -> None:
    """For one trace: per (layer, KV head), rows = eviction steps, columns = token positions; a cell is lit
    when the token is in that head's cache right after the step (KVpop's Figure 6 style)."""
    from foresight.targets.golden import GoldenPolicy
    from foresight.engine.rollout import RolloutOptions, rollout

    S = ref["ids"].shape[1]
    maps = []

    def rec(st):
        tok = st["token"]  # [nl, 1, h, n] before eviction
        drop = torch.zeros_like(tok, dtype=torch.bool).scatter_(-1, st["chosen"], True)
        kept = torch.zeros(tok.shape[0], tok.shape[2], S, dtype=torch.bool)
        t = tok[:, 0].clamp(min=0)
        kept.scatter_(-1, t.cpu(), (~drop[:, 0] & (tok[:, 0] >= 0)).cpu())
        maps.append(kept)

    pol = GoldenPolicy(future) if method.teacher_forced_only else method.make_policy()
    settings = method.settings(B, L, "evict")
    rollout(model, ref["ids"], pol, settings, prompt_len=ref["prompt_len"], recorder=rec,
            options=RolloutOptions(generator=torch.Generator().manual_seed(0)))
    if not maps:
        return
    m = torch.stack(maps)  # [steps, nl, h, S]
    steps, nl, h, _ = m.shape
    fig, axes = plt.subplots(nl, h, figsize=(3.2 * h, 1.1 * nl + 0.8), squeeze=False)
    for i in range(nl):
        for j in range(h):
            ax = axes[i][j]
            ax.imshow(m[:, i, j].float().numpy(), aspect="auto", cmap="Greys", interpolation="nearest")
            ax.axvline(ref["prompt_len"] - 0.5, color="tab:red", lw=0.6)
            ax.set_title(f"layer {i} head {j}", fontsize=7)
            ax.set_yticks([])
            ax.tick_params(labelsize=6)
    fig.suptitle(f"{method.name}, B={B}, L={L}: kept tokens (x) after each eviction step (y); red = end of prompt",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
