"""The report as a markdown table: one line per measurement (row, case, measured, reference, ratio)."""

from __future__ import annotations


def _cell(e: dict) -> tuple[str, str, str]:
    """(measured, reference, ratio) of one measurement, as table cells."""
    if "skipped" in e or "error" in e:
        return e.get("skipped") or e["error"], "—", "—"
    if e.get("oom"):
        return "out of memory", "—", "—"
    row, ratio = e["row"], f"{e['ratio']:.2f}×" if "ratio" in e else "—"
    if row in ("rollout", "group"):
        return f"rollout {e['rollout_s']:.3f} s", f"dense {e['dense_s']:.3f} s", ratio
    if row == "golden":
        return f"golden {e['golden_s']:.3f} s", f"dense {e['dense_s']:.3f} s", ratio
    if row == "decode":
        vs_full = f"{e['vs_full']:.2f}× full cache" if "vs_full" in e else "—"
        return f"{e['ms_per_token']:.2f} ms/token, {e['tokens_per_s']:,.0f} tokens/s", f"prefill {e['prefill_s']:.3g} s", vs_full
    if row == "memory" and "peak_gib" in e:
        return f"{e['peak_gib']:.2f} GiB above the weights", f"weights {e['weights_gib']:.2f} GiB", "—"
    if row == "memory":
        return f"largest transient {e['largest_transient']:,} values", f"bound {e['bound']:,}", "—"
    if row == "fit":
        stop = f"out of memory at {e['first_oom']}" if e["first_oom"] else e.get("stopped") or f"cap {e['cap']}"
        return f"largest batch {e['largest_batch']}", stop, "—"
    return f"{e['per_chunk_layer']} {e['unit']} / chunk / layer", f"plain forward {e['plain_per_chunk_layer']}", ratio


def gpu_table(report: dict) -> str:
    s = report["settings"]
    lines = [f"gpubench: shape {s['shape']} on {report['device']['name']} ({s['device']}), B={s['budget']}, "
             f"L={s['interval']}, best of {s['repeat']}", "", "| row | case | measured | reference | ratio |",
             "|---|---|---|---|---|"]
    for e in report["rows"]:
        lines.append(f"| {e['row']} | {e['case']} | " + " | ".join(_cell(e)) + " |")
    return "\n".join(lines)

