"""The golden-ranking objective of SFT and its metrics, on rows of candidates.

A row is one (layer, eviction step, KV head): ``phi`` [R, n] the scorer's eviction scores (higher = evict first),
``fut`` [R, n] golden's future scores, ``cand`` [R, n] which slots are candidates. The loss
(:func:`pairwise_hinge`, paper §3.2) and the metrics that compare the scorer's ``k`` evictions with golden's:
:func:`recall_at_l` (the overlap of the two sets) and :func:`lost_future` (the future score each set evicts — what the
overlap does not weigh: a swap of two pairs nothing will attend to costs nothing).
"""

from __future__ import annotations

import dataclasses

import torch

from foresight.engine.selection import top_indices, topk_overlap
from foresight.config.checks import PAIR_WEIGHTS


@dataclasses.dataclass(frozen=True)
class HingeSettings:
    """The pairwise hinge's settings (a recipe's ``sft`` section: :meth:`from_sft`).

    ``margin``: the hinge's margin. ``pairs``: ``all`` pairs, ``sampled`` pairs, or ``boundary``: ``sampled`` pairs
    across golden's eviction set, one of the ``k`` candidates golden evicts against one it keeps (the order inside
    either set does not count: top-k eviction and recall@L depend only on the set). ``sampled``: pairs drawn per row.
    ``chunk``: with ``all`` pairs, at most this many pair values at once (rows are taken a slice at a time).
    ``k``: golden's evictions per row (``boundary``). ``weight``: ``uniform`` or ``gap`` (each pair weighted by its
    future-score gap)."""

    margin: float = 0.01
    pairs: str = "all"
    sampled: int = 4096
    chunk: int = 1 << 24
    k: int = 0
    weight: str = "uniform"

    @classmethod
    def from_sft(cls, cfg, k: int) -> "HingeSettings":
        """A recipe's ``sft`` section's (margin, pairs, sampled_pairs, pair_chunk, pair_weight); ``k``: the interval
        L."""
        return cls(cfg.margin, cfg.pairs, cfg.sampled_pairs, cfg.pair_chunk, k, cfg.pair_weight)


def pairwise_hinge(phi, fut, cand, settings: HingeSettings = HingeSettings(), generator=None):
    """Per-row (weighted) mean hinge over ordered pairs; phi, fut, cand: [R, n]. Returns (mean over rows with pairs,
    rows). ``settings``: the margin, which pairs and how they are weighted (:class:`HingeSettings`); ``generator``:
    draws the sampled pairs."""
    margin, mode, sampled, chunk, k, weight = (settings.margin, settings.pairs, settings.sampled, settings.chunk,
                                               settings.k, settings.weight)
    R, n = phi.shape
    if weight not in PAIR_WEIGHTS:
        raise ValueError(f"sft.pair_weight must be one of {', '.join(PAIR_WEIGHTS)}, got {weight!r}")
    gap = weight == "gap"
    if mode == "boundary":
        return boundary_hinge(phi, fut, cand, margin, sampled, k, generator, gap)
    if mode == "all":
        per_row = []
        rows_per_chunk = max(1, chunk // max(1, n * n))
        for r0 in range(0, R, rows_per_chunk):
            p, f, c = phi[r0:r0 + rows_per_chunk], fut[r0:r0 + rows_per_chunk], cand[r0:r0 + rows_per_chunk]
            pair = (f.unsqueeze(2) < f.unsqueeze(1)) & c.unsqueeze(2) & c.unsqueeze(1)
            w = (f.unsqueeze(1) - f.unsqueeze(2)) * pair if gap else pair.float()
            h = torch.relu(margin - (p.unsqueeze(2) - p.unsqueeze(1))) * w
            per_row.append(torch.stack([h.sum((1, 2)), w.sum((1, 2))], -1))
        sums = torch.cat(per_row)
    elif mode == "sampled":
        i = torch.randint(0, n, (R, sampled), generator=generator).to(phi.device)
        j = torch.randint(0, n, (R, sampled), generator=generator).to(phi.device)
        fi, fj = fut.gather(1, i), fut.gather(1, j)
        ok = cand.gather(1, i) & cand.gather(1, j) & (fi != fj)
        lo_i = fi < fj  # orient each pair so that the first element should be evicted first
        pi, pj = phi.gather(1, i), phi.gather(1, j)
        d = torch.where(lo_i, pi - pj, pj - pi)
        w = (fi - fj).abs() * ok if gap else ok.float()
        h = torch.relu(margin - d) * w
        sums = torch.stack([h.sum(1), w.sum(1)], -1)
    else:
        raise ValueError(f"sft.pairs must be 'all', 'sampled' or 'boundary', got {mode!r}")
    return mean_over_rows(phi, sums)


def mean_over_rows(phi, sums):
    """(mean over the rows that have pairs of their mean hinge, how many rows): ``sums`` [R, 2] = (Σ weighted hinge,
    Σ pair weights)."""
    has = sums[:, 1] > 0
    if not has.any():
        return phi.sum() * 0.0, 0
    return (sums[has, 0] / sums[has, 1]).mean(), int(has.sum())


def golden_top(fut, cand, k: int) -> torch.Tensor:
    """[R, k] golden's k evictions among each row's candidates: lowest future first, then the oldest."""
    return top_indices((-fut).masked_fill(~cand, torch.finfo(fut.dtype).min), k)


def golden_set(fut, cand, k: int) -> torch.Tensor:
    """[R, n] mask of :func:`golden_top`'s slots (candidates only)."""
    return torch.zeros_like(cand).scatter_(1, golden_top(fut, cand, k), True) & cand


def boundary_hinge(phi, fut, cand, margin: float, sampled: int, k: int, generator=None, gap: bool = False):
    """Hinge over ``sampled`` pairs per row (i, j): i drawn from golden's k evictions, j from the candidates it keeps
    (``gap``: each weighted by ``F_j − F_i``)."""
    if k < 1:
        raise ValueError("sft.pairs='boundary' needs the eviction size k = cache.interval >= 1")
    gold = golden_set(fut, cand, k)
    rest = cand & ~gold
    valid = gold.any(1) & rest.any(1)
    one = torch.ones_like(gold[0], dtype=torch.float32)
    wi = torch.where(valid[:, None], gold.float(), one).cpu()  # rows without pairs draw anything, masked below
    wj = torch.where(valid[:, None], rest.float(), one).cpu()
    i = torch.multinomial(wi, sampled, replacement=True, generator=generator).to(phi.device)
    j = torch.multinomial(wj, sampled, replacement=True, generator=generator).to(phi.device)
    fi, fj = fut.gather(1, i), fut.gather(1, j)
    ok = valid[:, None] & (fi < fj)  # an exact tie at the boundary orders nothing
    w = (fj - fi) * ok if gap else ok.float()
    h = torch.relu(margin - (phi.gather(1, i) - phi.gather(1, j))) * w
    return mean_over_rows(phi, torch.stack([h.sum(1), w.sum(1)], -1))


def scorer_top(phi, cand, k: int) -> torch.Tensor:
    """[R, k] the scorer's k evictions among each row's candidates (highest eviction score first)."""
    return top_indices(phi.masked_fill(~cand, torch.finfo(phi.dtype).min), k)


def recall_at_l(phi, fut, cand, k: int) -> torch.Tensor:
    """[R] |scorer's top-k eviction set ∩ golden set| / k within each row's candidates."""
    return topk_overlap(scorer_top(phi, cand, k), golden_top(fut, cand, k))


def lost_future(phi, fut, cand, k: int) -> torch.Tensor:
    """[R, 2] per row: the summed future score of the scorer's top-k evictions and of golden's (golden's is the least
    any k candidates can lose, so the first is never below the second)."""
    return torch.stack([fut.gather(1, scorer_top(phi, cand, k)).sum(1), fut.gather(1, golden_top(fut, cand, k)).sum(1)],
                       -1)
