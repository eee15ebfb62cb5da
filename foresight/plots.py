"""Figures for the evaluation: metric-vs-budget curves and an eviction map (which tokens each head kept)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def budget_curves(rows: list[dict], out: Path) -> None:
    for metric, fname, ylabel in (("accuracy", "accuracy.png", "accuracy (pass@1, avg@n)"),
                                  ("loss_ratio", "loss_ratio.png", "loss ratio (evicted / full NLL)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series = {}
        for r in rows:
            if r[metric] is None:
                continue
            label = r["method"] + (" +prompt" if r["protect_prompt"] and r["method"] != "random-keep-prompt" else "")
            series.setdefault(label, []).append((r["budget"], r[metric]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xlabel("budget B (pairs per head)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(Path(out) / fname, dpi=110)
        plt.close(fig)


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
