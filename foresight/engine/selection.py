"""Which L candidates to evict, given eviction scores (higher = evict first).

* ``topk``: deterministic, evict the L highest-scoring candidates.
* ``sample``: the paper's Top-2L sampler (ForesightKV §3.1, App. B.2): take the 2L candidates most likely to
  be evicted, then draw L of them without replacement from softmax(score / τ), i.e. sequential
  Plackett–Luce sampling (implemented with the Gumbel-top-k trick, which draws from exactly that law).

Log-probabilities (needed by GRPO):

* :func:`ordered_logprob` — log P of the drawn *sequence* under Plackett–Luce:
  ``Σ_i [z_{σ_i} − logsumexp_{j ∉ {σ_1..σ_{i−1}}} z_j]`` with ``z = score/τ`` restricted to the 2L candidates
  (:func:`window_draw_logprobs`: its terms, one per draw; the sampler returns its draws in draw order).
* :func:`set_logprob` — log P of the drawn *set* (order ignored), the probability of the action the MDP
  actually takes. With weights ``w = exp(z)``, draws without replacement are an exponential race (item i
  arrives at ``E_i ~ Exp(w_i)``); the first k arrivals are the set S iff all of S arrive before the first of
  the rest R::

      P(S) = ∫_0^∞ W_R e^{−W_R t} Π_{i∈S} (1 − e^{−w_i t}) dt,      W_R = Σ_{j∈R} w_j

  a one-dimensional integral evaluated in log space on a log-t grid (exact to ~1e-6 relative; tested against
  brute-force enumeration of all orders). Differentiable in the scores.

Candidates outside the top-2L window have probability 0 under the sampler; their log-probability is clamped
to ``NEG`` so that ratios stay finite.
"""

from __future__ import annotations

import math

import torch

NEG = -1e4


def masked_scores(scores: torch.Tensor, evictable: torch.Tensor) -> torch.Tensor:
    return scores.float().masked_fill(~evictable, float("-inf"))


def top_indices(s: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k largest values, equal values in slot order (slots are in token order: the oldest
    first). ``topk`` breaks ties as each device's kernel happens to (max-pooled scores such as SnapKV's and R-KV's
    tie between neighbours, so CPU and GPU kept different pairs); a stable sort breaks them the same everywhere."""
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]


def select_topk(scores: torch.Tensor, evictable: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k highest eviction scores among evictable slots (ties: the oldest slot first)."""
    return top_indices(masked_scores(scores, evictable), k)


def topk_overlap(mine: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """[...] share of the slots ``mine`` [..., k] that are also in ``other`` [..., k'] (e.g. recall@L of a scorer's
    eviction set against the golden one)."""
    return (mine.unsqueeze(-1) == other.unsqueeze(-2)).any(-1).float().sum(-1) / mine.shape[-1]


def choose(scores: torch.Tensor, evictable: torch.Tensor, k: int, mode: str = "topk", temperature: float = 1.0,
           generator: torch.Generator | None = None, check: bool = True) -> torch.Tensor:
    """The k slots [..., k] to evict from the candidates ``evictable`` by ``scores``: ``topk``, ``sample`` (the
    Top-2L sampler at ``temperature``) or ``multinomial`` (the same draw over every candidate: the paper's "MN"
    ablation). ``check``: that every row has k candidates (a host sync; a caller that knows may skip it)."""
    if check:
        n_cand = int(evictable.sum(-1).min())
        if n_cand < k:
            raise RuntimeError(f"only {n_cand} evictable pairs for {k} evictions: B, L, sinks and the protected prompt "
                               "leave too little room")
    if mode in ("sample", "multinomial"):
        return sample_top2l(scores, evictable, k, temperature, generator,
                            width=scores.shape[-1] if mode == "multinomial" else None)
    return select_topk(scores, evictable, k)


def kept_slots(chosen: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n - k]: the slots among the first n that ``chosen`` [..., k] leaves, ascending per row (a stable sort of
    the drop mask puts the kept slots first in slot order: no host sync, unlike ``nonzero``)."""
    drop = torch.zeros(*chosen.shape[:-1], n, dtype=torch.bool, device=chosen.device).scatter_(-1, chosen, True)
    return torch.sort(drop, dim=-1, stable=True).indices[..., :n - chosen.shape[-1]]


def candidate_window(scores: torch.Tensor, evictable: torch.Tensor, k: int, width: int | None = None):
    """The Top-2L window: indices [..., m] (m = min(2k, n)) of the highest scores, and their masked scores."""
    m = min(width or 2 * k, scores.shape[-1])
    s = masked_scores(scores, evictable)
    idx = top_indices(s, m)
    return idx, s.gather(-1, idx)


def sample_top2l(scores: torch.Tensor, evictable: torch.Tensor, k: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None, width: int | None = None) -> torch.Tensor:
    """Draw k slots to evict: Plackett–Luce without replacement within the top-2k window (``width``: another
    window; non-candidates, at -inf, are never drawn).

    Returns slot indices [..., k] in draw order.
    """
    idx, vals = candidate_window(scores, evictable, k, width)
    z = vals / temperature
    u = torch.rand(z.shape, generator=generator, device=z.device if generator is None else generator.device)
    u = u.to(z.device).clamp_(1e-12, 1 - 1e-7)
    gumbel = -torch.log(-torch.log(u))
    order = (z + gumbel).topk(k, dim=-1).indices  # Gumbel-top-k = sequential sampling w/o replacement
    return idx.gather(-1, order)


def window_logits(scores: torch.Tensor, win: torch.Tensor, evictable: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampler's logits z = score / τ over a fixed window of slots ``win`` [..., m] (GRPO holds the behaviour
    policy's window fixed)."""
    return masked_scores(scores, evictable).gather(-1, win) / temperature


def _window_logits(scores, evictable, chosen, k, temperature):
    """z over the current top-2k window, and the positions of `chosen` in it (or -1 when outside)."""
    idx, _ = candidate_window(scores, evictable, k)
    z = window_logits(scores, idx, evictable, temperature)
    match = chosen.unsqueeze(-1) == idx.unsqueeze(-2)  # [..., k, m]
    inside = match.any(-1)
    pos = match.float().argmax(-1)
    return z, pos, inside


def ordered_logprob(scores, evictable, chosen, temperature: float = 1.0) -> torch.Tensor:
    """log P(the ordered draw ``chosen`` [..., k]) under the Top-2L Plackett–Luce sampler."""
    k = chosen.shape[-1]
    z, pos, inside = _window_logits(scores, evictable, chosen, k, temperature)
    lp = window_draw_logprobs(z, pos).sum(-1)
    return torch.where(inside.all(-1), lp, torch.full_like(lp, NEG))


def window_draw_logprobs(z: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[..., k]: log P(draw i | draws 1..i−1) of the ordered draw of window positions ``pos`` [..., k] under
    Plackett–Luce over window logits ``z`` [..., m] (-inf: an empty slot), i.e. ``z_{σ_i} − logsumexp`` over the
    window minus the earlier draws. Their sum is the ordered sequence's log-probability; GRPO's per-draw ratios
    (``grpo.ratio=draw``) are taken on each term, like the per-token ratios of language-model GRPO."""
    k, m = pos.shape[-1], z.shape[-1]
    zc = z.gather(-1, pos)  # [..., k]
    onehot = torch.nn.functional.one_hot(pos, m).bool()  # [..., k, m]
    taken = torch.zeros(z.shape[:-1] + (k, m), dtype=torch.bool, device=z.device)
    taken[..., 1:, :] = onehot[..., :-1, :].cumsum(-2).bool()  # drawn before draw i
    denom = torch.logsumexp(z.unsqueeze(-2).masked_fill(taken, float("-inf")), dim=-1)
    return zc - denom


def set_logprob(scores, evictable, chosen, temperature: float = 1.0, grid: int = 512) -> torch.Tensor:
    """log P(the set ``chosen`` [..., k], any order) under the Top-2L Plackett–Luce sampler."""
    k = chosen.shape[-1]
    z, pos, inside = _window_logits(scores, evictable, chosen, k, temperature)
    lp = window_set_logprob(z, pos, grid)
    return torch.where(inside.all(-1), lp, torch.full_like(lp, NEG))


def window_set_logprob(z: torch.Tensor, pos: torch.Tensor, grid: int = 512) -> torch.Tensor:
    """log P(the set of window positions ``pos`` [..., k]) for Plackett–Luce draws over window logits ``z``
    [..., m] (-inf marks an empty window slot). Used with a fixed window by GRPO (the behaviour policy's)."""
    m = z.shape[-1]
    in_set = torch.nn.functional.one_hot(pos, m).sum(-2).bool()  # [..., m]
    zmax = z.masked_fill(~torch.isfinite(z), float("-inf")).amax(-1, keepdim=True)
    zn = (z - zmax).masked_fill(~torch.isfinite(z), float("-inf"))  # weights w = exp(zn) <= 1
    log_wr = torch.logsumexp(zn.masked_fill(in_set, float("-inf")), dim=-1)  # log W_R
    no_rest = ~torch.isfinite(log_wr)  # the set is the whole window: probability 1
    log_wr = torch.where(no_rest, torch.zeros_like(log_wr), log_wr)
    ws = zn.masked_fill(~in_set, float("-inf"))
    w_min = ws.masked_fill(~in_set, float("inf")).amin(-1)
    # integrate over s = log t: a coarse pass locates the integrand's mass, a fine pass integrates it
    lo = torch.minimum(-log_wr, -w_min.clamp(max=30)) - 12.0
    hi = -log_wr + 4.0
    wsd, lwr = ws.double().exp(), log_wr.double()

    def log_f(s):  # [..., grid] -> log of the integrand in s = log t (including the dt = t ds factor)
        t = s.exp()
        wt = wsd.unsqueeze(-2) * t.unsqueeze(-1)  # [..., grid, m]
        log1m = torch.log(-torch.expm1(-wt.clamp(min=1e-300)))
        log1m = torch.where(in_set.unsqueeze(-2), log1m, torch.zeros_like(log1m))
        return lwr.unsqueeze(-1) - lwr.exp().unsqueeze(-1) * t + log1m.sum(-1) + s

    frac = torch.linspace(0.0, 1.0, grid, device=z.device, dtype=torch.float64)
    s0 = lo.double().unsqueeze(-1) + (hi - lo).double().unsqueeze(-1) * frac
    f0 = log_f(s0)
    above = f0 > f0.amax(-1, keepdim=True) - 40.0
    first = above.double().argmax(-1)
    last = grid - 1 - above.flip(-1).double().argmax(-1)
    step = (hi - lo).double() / (grid - 1)
    lo2 = lo.double() + (first - 1).clamp(min=0) * step
    hi2 = lo.double() + (last + 1).clamp(max=grid - 1) * step
    s1 = lo2.unsqueeze(-1) + (hi2 - lo2).unsqueeze(-1) * frac
    h = (hi2 - lo2) / (grid - 1)
    trap = torch.full((grid,), 1.0, dtype=torch.float64, device=z.device)
    trap[0] = trap[-1] = 0.5
    lp = (torch.logsumexp(log_f(s1) + trap.log(), dim=-1) + h.log()).to(z.dtype)
    return torch.where(no_rest, torch.zeros_like(lp), lp)


def brute_force_set_logprob(z: torch.Tensor, chosen: list[int]) -> float:
    """Reference: log Σ over all orders of ``chosen`` of the Plackett–Luce sequence probability (small cases)."""
    import itertools

    total = 0.0
    for perm in itertools.permutations(chosen):
        remaining = list(range(len(z)))
        p = 1.0
        for i in perm:
            w = torch.tensor([z[j] for j in remaining]).exp()
            p *= math.exp(z[i]) / w.sum().item()
            remaining.remove(i)
        total += p
    return math.log(total)
