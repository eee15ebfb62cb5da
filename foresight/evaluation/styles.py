"""One fixed style per evaluated method, in every figure: the learned scorers in saturated colours and thick lines, the
heuristics in one muted family told apart by their markers, golden, kvpop-oracle and the full cache as black/grey
reference lines; plus what a figure says it shows (model, traces, budgets) and when an axis is logarithmic."""

from __future__ import annotations

import hashlib
import math

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
    "lookahead": ("#9f8f6b", "d"),
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


def series(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(series_label(r), []).append(r)
    for pts in out.values():
        pts.sort(key=lambda r: r["budget"])
    return dict(sorted(out.items(), key=lambda kv: (_GROUP_ORDER[method_group(kv[1][0]["method"])], kv[0])))


def style_of(rows: list[dict]) -> dict:
    style = method_style(rows[0]["method"])
    if series_label(rows[0]) != rows[0]["method"]:
        style["markerfacecolor"] = "white"  # +prompt: hollow markers
    return style


def choose_scale(values) -> str:
    """``log`` when the positive values span more than two decades, else ``linear``."""
    pos = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return "log" if len(pos) >= 2 and max(pos) / min(pos) > 100 else "linear"


def budgets(rows):
    return sorted({(r["budget"], r["interval"]) for r in rows})


def pct(B: int, meta: dict | None) -> str:
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
    listed = ", ".join(f"{B}:{L}{pct(B, meta)}" for B, L in budgets(rows))
    return sep.join((what, traces, f"budgets B:L {listed}"))


