"""Figures for the evaluation — metric-vs-budget curves, the demo's headline figure, a one-line-per-budget summary —
and an eviction map (which tokens each head kept).

Every method has one fixed style in every figure (:func:`method_style`): the learned scorers in saturated colours
and thick lines, the heuristics in one muted family told apart by their markers, golden, kvpop-oracle and the full
cache as black/grey reference lines. Axes whose values span more than two decades are logarithmic.

    python -m foresight.plots --results runs/tiny-qwen3/eval                          # redraw the figures there
    python -m foresight.plots --results runs/tiny-qwen3/eval --headline docs/demo.png  # the README's figure
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.transforms import offset_copy  # noqa: E402

# --- one style per method ------------------------------------------------------------------------------------------

LEARNED = {  # saturated, thick, drawn on top
    "foresight-grpo": ("#d62728", "o"),
    "foresight-sft": ("#ff7f0e", "s"),
    "kvpop-mlp": ("#9467bd", "D"),
    "kvpop-mlstm-delayed": ("#1f77b4", "^"),
    "kvpop-mlstm-immediate": ("#17becf", "v"),
}
REFERENCE = {  # no eviction / needs the future: reference lines
    "full": dict(color="black", linestyle=":", linewidth=1.6, marker=""),
    "golden": dict(color="black", linestyle="--", linewidth=1.6, marker="*", markersize=8),
    "kvpop-oracle": dict(color="#555555", linestyle="-.", linewidth=1.4, marker="*", markersize=7),
}
HEURISTIC = {  # one muted family: desaturated colours, thin lines, a distinct marker each
    "rkv": ("#5f7f99", "P"),
    "snapkv": ("#8e8cb0", "D"),
    "h2o": ("#7a9a8a", "^"),
    "tova": ("#a38f7a", "v"),
    "scissorhands": ("#a3859a", "X"),
    "streamingllm": ("#8c9fb1", "s"),
    "knorm": ("#9aa37a", "<"),
    "keydiff": ("#7aa3a3", ">"),
    "random-keep-prompt": ("#8a8a8a", "h"),
    "random": ("#b5b5b5", "o"),
}
_FALLBACK_LEARNED = ["#e377c2", "#8c564b", "#2ca02c", "#bcbd22"]  # unknown scorers: saturated, unused above
_FALLBACK_COLOURS = ["#6b8e9f", "#9f8b6b", "#8b6b9f", "#6b9f7c", "#9f6b7a", "#7a7a9f", "#9f9a6b", "#6b9f9c"]
_FALLBACK_MARKERS = ["p", "H", "d", "8", "1", "2", "3", "4"]
_VARIANT_LINESTYLES = ["--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 2))]


def _digest(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16)  # stable across runs (str hash is salted)


def _base(name: str) -> tuple[str, str]:
    """``foresight-sft(run2)`` -> (``foresight-sft``, ``run2``): eval suffixes a checkpoint name seen twice."""
    if name.endswith(")") and "(" in name:
        i = name.index("(")
        return name[:i], name[i + 1:-1]
    return name, ""


def method_group(name: str) -> str:
    """``learned`` (a trained scorer), ``reference`` (full, golden, kvpop-oracle) or ``heuristic`` (anything else)."""
    base, _ = _base(name)
    if base in REFERENCE:
        return "reference"
    if base in LEARNED or base.startswith("foresight-") or base.startswith("kvpop-"):
        return "learned"
    return "heuristic"


def method_style(name: str) -> dict:
    """The matplotlib line style (``color``, ``marker``, ``linestyle``, ``linewidth``, ``markersize``, ``zorder``)
    of a method, the same in every figure. Unknown names get a deterministic style of their group; a checkpoint name
    with a suffix (``foresight-sft(run2)``) keeps its base's colour and marker with a broken line."""
    base, suffix = _base(name)
    group = method_group(name)
    if base in REFERENCE:
        style = dict(REFERENCE[base], zorder=4)
    else:
        table = LEARNED if group == "learned" else HEURISTIC
        if base in table:
            colour, marker = table[base]
        else:
            h = _digest(base)
            palette = _FALLBACK_LEARNED if group == "learned" else _FALLBACK_COLOURS
            colour = palette[h % len(palette)]
            marker = _FALLBACK_MARKERS[(h // 7) % len(_FALLBACK_MARKERS)]
        if group == "learned":
            style = dict(color=colour, marker=marker, linestyle="-", linewidth=2.6, markersize=7.5, zorder=6)
        else:
            style = dict(color=colour, marker=marker, linestyle="-", linewidth=1.2, markersize=6, zorder=3)
    if suffix:
        style["linestyle"] = _VARIANT_LINESTYLES[_digest(suffix) % len(_VARIANT_LINESTYLES)]
    return style


# --- rows -> series ------------------------------------------------------------------------------------------------

METRICS = {  # metric -> (interval key, panel title, lower/higher is better)
    "accuracy": (None, "task accuracy (greedy pass@1)", "higher is better"),
    "low_entropy_loss_increase": ("low_entropy_loss_increase_ci", "loss increase per token, low-entropy tokens (nats)",
                                  "lower is better"),
    "high_entropy_loss_increase": ("high_entropy_loss_increase_ci",
                                   "loss increase per token, high-entropy tokens (nats)", "lower is better"),
    "loss_ratio": ("loss_ratio_ci", "loss ratio (evicted / full-cache NLL)", "lower is better"),
}
RESOLUTION = 1e-5  # results.json rounds the loss increases to 5 decimals
_GROUP_ORDER = {"learned": 0, "reference": 1, "heuristic": 2}


def series_label(row: dict) -> str:
    """A row's curve: the method, with ``+prompt`` when it protected the prompt (random-keep-prompt always does)."""
    prot = row.get("protect_prompt") and row["method"] != "random-keep-prompt"
    return row["method"] + (" +prompt" if prot else "")


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(series_label(r), []).append(r)
    for pts in out.values():
        pts.sort(key=lambda r: r["budget"])
    return dict(sorted(out.items(), key=lambda kv: (_GROUP_ORDER[method_group(kv[1][0]["method"])], kv[0])))


def _style(rows: list[dict]) -> dict:
    style = method_style(rows[0]["method"])
    if series_label(rows[0]) != rows[0]["method"]:
        style["markerfacecolor"] = "white"  # +prompt: hollow markers
    return style


def choose_scale(values) -> str:
    """``log`` when the positive values span more than two decades, else ``linear``."""
    pos = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return "log" if len(pos) >= 2 and max(pos) / min(pos) > 100 else "linear"


def _budgets(rows):
    return sorted({(r["budget"], r["interval"]) for r in rows})


def _pct(B: int, meta: dict | None) -> str:
    n = (meta or {}).get("mean_trace_length")
    return f" ({100 * B / n:.0f}%)" if n else ""


def describe(rows: list[dict], meta: dict | None, sep: str = " — ") -> str:
    """What a figure shows: model, traces and budgets (one line, or one line each with ``sep="\\n"``)."""
    meta = meta or {}
    n = meta.get("num_problems") or (rows[0].get("num_problems") if rows else None)
    what = meta.get("model") or "model ?"
    if meta.get("recipe"):
        what += f" (recipe {meta['recipe']})"
    traces = f"{n} held-out traces" if n else "held-out traces"
    if meta.get("mean_trace_length"):
        traces += f", mean {meta['mean_trace_length']:,.0f} tokens"
        if meta.get("mean_prompt_length"):
            traces += f" (prompt {meta['mean_prompt_length']:,.0f})"
    budgets = ", ".join(f"{B}:{L}{_pct(B, meta)}" for B, L in _budgets(rows))
    return sep.join((what, traces, f"budgets B:L {budgets}"))


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
                            ha="left", va="bottom", fontsize=7)
            continue
        drawn[label] = pts
    values = [r[metric] for pts in drawn.values() for r in pts]
    scale = "linear" if metric == "accuracy" else choose_scale(values + ([1.0] if metric == "loss_ratio" else []))
    ax.set_yscale(scale)
    pos = [v for v in values if v > 0]
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


# --- the summary ---------------------------------------------------------------------------------------------------


def _best(rows: list[dict]) -> dict | None:
    """Highest accuracy; ties (and rows without accuracy) by the lower low-entropy loss increase."""
    if not rows:
        return None
    return min(rows, key=lambda r: (-(r["accuracy"] if r.get("accuracy") is not None else -1.0),
                                    r.get("low_entropy_loss_increase") or 0.0))


def _dl(v) -> str:
    if v is None:
        return "—"
    return f"<{RESOLUTION:g}".replace("e-0", "e-") if abs(v) < RESOLUTION else f"{v:.3g}"


def _who(r: dict | None) -> str:
    if r is None:
        return "—"
    acc = "" if r.get("accuracy") is None else f"accuracy {r['accuracy']:.2f}, "
    return f"{series_label(r)} ({acc}Δloss {_dl(r.get('low_entropy_loss_increase'))})"


def summary_lines(rows: list[dict], meta: dict | None = None) -> list[str]:
    """At each budget, one line: the best learned scorer, the best heuristic and golden (best = highest accuracy,
    then lowest loss increase on low-entropy tokens)."""
    full = [r for r in rows if r["method"] == "full" and r.get("accuracy") is not None]
    head = "summary: " + describe(rows, meta)
    if full:
        head += f"; full cache accuracy {sum(r['accuracy'] for r in full) / len(full):.2f}"
    lines = [head, "  (accuracy: greedy task accuracy; Δloss: mean loss increase per low-entropy token, nats; "
                   "best = highest accuracy, then lowest Δloss)"]
    for B, L in _budgets(rows):
        at = [r for r in rows if (r["budget"], r["interval"]) == (B, L)]
        learned = _best([r for r in at if method_group(r["method"]) == "learned"])
        heur = _best([r for r in at if method_group(r["method"]) == "heuristic"])
        golden = next((r for r in at if r["method"] == "golden"), None)
        lines.append(f"  B={B}:{L}{_pct(B, meta)}: best learned {_who(learned)} | best heuristic {_who(heur)} | "
                     f"golden Δloss {_dl(golden and golden.get('low_entropy_loss_increase'))}")
    return lines


# --- python -m foresight.plots -------------------------------------------------------------------------------------


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
    from foresight.golden import GoldenPolicy
    from foresight.rollout import rollout

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
            generator=torch.Generator().manual_seed(0))
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
