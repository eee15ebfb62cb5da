"""One (method, budget) row of ``foresight eval`` from its held-out traces: per-trace sums of the teacher-forced
losses (kept in the row's ``per_trace`` for paired comparisons) and the ratios they add up to, with bootstrap
intervals over the traces."""

from __future__ import annotations

import torch

from foresight.config.eviction import EvictionSettings
from foresight.evaluation.report import bootstrap_ci
from foresight.targets.reward import low_entropy_mask


def loss_increases(loss, full_loss, entropy, start: int):
    """One trace's per-token loss increase (evicted − full) after the first eviction (token ``start``), on the
    low-entropy tokens (the lowest 80% by full-cache entropy) and on the rest."""
    low = low_entropy_mask(entropy, start, 0.8)
    after = torch.zeros_like(low)
    after[start:] = True
    delta = loss - full_loss
    return delta[low], delta[after & ~low]


class TraceMetrics:
    """Per-trace sums of one (method, budget) row, and the row they add up to (with bootstrap intervals)."""

    def __init__(self):
        self.evicted, self.full, self.held, self.peak, self.traces = [], [], [], [], []
        self.low, self.high = [], []  # per trace: (sum of increases, tokens)
        self.recalls: dict[int, list[float]] = {}  # per trace: its recall@L at each golden step
        self.keep: dict[int, list[float]] = {}  # per trace: its keep recall at each golden step

    def add_recalls(self, batch: dict, hits: list[tuple[int, float, float]]) -> None:
        """A golden pass's (row of ``batch``, recall@L, keep recall), filed under each row's trace."""
        for r, v, kv in hits:
            self.recalls.setdefault(batch["members"][r], []).append(v)
            self.keep.setdefault(batch["members"][r], []).append(kv)

    def add(self, loss, held, batch: dict, protected: bool, settings: EvictionSettings) -> None:
        for r, (S, p) in enumerate(zip(batch["lengths"], batch["prompt_lens"])):
            self.evicted.append(loss[r, p:S].sum().item())
            self.full.append(batch["loss"][r, p:S].sum().item())
            start = min((p if protected else 0) + settings.budget + settings.interval + 1, S)
            low, high = loss_increases(loss[r, :S], batch["loss"][r, :S], batch["entropy"][r, :S], start)
            self.low.append((low.sum().item(), low.numel()))
            self.high.append((high.sum().item(), high.numel()))
            self.held.append(held[r, p:S].mean().item())  # pairs seen per generated token
            self.peak.append(held[r, p:S].max().item())
            self.traces.append(batch["members"][r])

    def row(self, seed: int) -> dict:
        def mean_of(pairs):
            n = sum(c for _, c in pairs)
            return round(sum(v for v, _ in pairs) / n, 5) if n else 0.0

        recalls = [(sum(v), len(v)) for v in self.recalls.values()]  # per trace: (sum over its steps, steps)
        keep = [(sum(v), len(v)) for v in self.keep.values()]

        def ci(pairs):
            kept = [(v, c) for v, c in pairs if c]
            return bootstrap_ci([v for v, _ in kept], [c for _, c in kept], seed) if kept else None

        return {"loss_ratio": round(sum(self.evicted) / max(sum(self.full), 1e-12), 5),
                "loss_ratio_ci": bootstrap_ci(self.evicted, self.full, seed),
                "low_entropy_loss_increase": mean_of(self.low), "low_entropy_loss_increase_ci": ci(self.low),
                "high_entropy_loss_increase": mean_of(self.high), "high_entropy_loss_increase_ci": ci(self.high),
                "recall_at_L": mean_of(recalls) if recalls else None, "recall_at_L_ci": ci(recalls) if recalls else None,
                "keep_recall": mean_of(keep) if keep else None, "keep_recall_ci": ci(keep) if keep else None,
                "mean_cache": round(sum(self.held) / len(self.held), 1), "peak_cache": round(max(self.peak), 1),
                "per_trace": {"evicted_loss": [round(x, 5) for x in self.evicted],
                              "full_loss": [round(x, 5) for x in self.full], "trace": self.traces,
                              "low_entropy": [[round(v, 6), c] for v, c in self.low],  # (sum of increases, tokens)
                              "high_entropy": [[round(v, 6), c] for v, c in self.high]}}
