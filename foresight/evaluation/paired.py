"""Paired bootstrap over held-out traces: the difference between two methods evaluated on the *same* traces.

Each method's own 95% interval includes the spread of trace difficulty (some held-out traces are hard for every
method), so two methods' intervals can overlap although one is better on nearly every trace. Resampling the traces
once and measuring both methods on each resample cancels that spread: the interval of the difference is the one that
says whether the methods are separated."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BOOTSTRAP = 1000  # resamples of the held-out traces for a 95% interval


def aligned(keys_a: Sequence, keys_b: Sequence) -> list[tuple[int, int]] | None:
    """Index pairs (i in a, j in b) that hold the same item, in sorted key order; None when the two sides do not hold
    the same set of distinct keys (not the same held-out traces, or a key used twice)."""
    if not keys_a or len(set(keys_a)) != len(keys_a) or sorted(keys_a) != sorted(keys_b):
        return None
    where_b = {k: j for j, k in enumerate(keys_b)}
    return sorted(((i, where_b[k]) for i, k in enumerate(keys_a)), key=lambda p: keys_a[p[0]])


def paired_diff_ci(num_a: Sequence[float], den_a: Sequence[float] | None, num_b: Sequence[float],
                   den_b: Sequence[float] | None, seed: int = 0) -> list[float] | None:
    """95% percentile interval of stat(b) − stat(a) over paired resamples of aligned items, where stat is the ratio
    of sums Σnum/Σden (a loss ratio, a mean over tokens) or the mean of ``num`` when ``den`` is None (an accuracy).
    Item k of every sequence is the same held-out trace; None when there are none."""
    if not len(num_a):
        return None
    if not len(num_a) == len(num_b) == len(den_a if den_a is not None else num_a) == len(den_b if den_b is not None else num_b):
        raise ValueError("paired_diff_ci: the two sides must hold the same number of aligned items")
    idx = resamples(len(num_a), seed)
    return percentile_interval(resampled_stat(num_b, den_b, idx) - resampled_stat(num_a, den_a, idx))


def resamples(n: int, seed: int) -> np.ndarray:
    """[BOOTSTRAP, n] indices of ``n`` items drawn with replacement (seeded: the same seed, the same resamples)."""
    return np.random.default_rng(seed).integers(0, n, size=(BOOTSTRAP, n))


def resampled_stat(num: Sequence[float], den: Sequence[float] | None, idx: np.ndarray) -> np.ndarray:
    """Per resample (a row of ``idx``): Σnum/Σden, or the mean of ``num`` when ``den`` is None."""
    n = np.asarray(num, dtype=np.float64)[idx]
    if den is None:
        return n.mean(1)
    return n.sum(1) / np.maximum(np.asarray(den, dtype=np.float64)[idx].sum(1), 1e-12)


def percentile_interval(stats: np.ndarray) -> list[float]:
    """The 95% percentile interval of bootstrap statistics, rounded to 5 decimals."""
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return [round(float(lo), 5), round(float(hi), 5)]
