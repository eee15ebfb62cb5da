"""Teacher-forced rollout: run a frozen model over fixed traces in chunks, with eviction in between.

The same driver serves the data stage (full cache: per-token loss and entropy), golden-trajectory feature
collection (SFT), GRPO rollouts (G trajectories of one trace as one batch) and the evaluation's loss ratio.
Chunks end exactly at eviction points (``BoundedCache.next_chunk``), so the statistics of each eviction
step cover exactly the L newest queries, and the result equals token-by-token generation with the same
deterministic policy (tested).

Per-token quantities use the convention ``x[t] = f(p(· | tokens < t), token t)`` for ``t ≥ 1`` and
``x[0] = 0``: ``token_loss[t] = −log p(token_t | tokens_<t)``, ``token_entropy[t] = H(p(· | tokens_<t))``.
Full-vocabulary logits exist for one chunk at a time only.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from transformers import DynamicCache

from foresight.engine.cache.bounded import BoundedCache
from foresight.engine.cache.fork import PrefixPolicy, fork
from foresight.config.eviction import EvictionSettings
from foresight.engine.recorded import RecordedChunks, capture_for, model_step
from foresight.engine.cache_keyword import cache_kwargs

# the full cache's chunks hold at most this many logits (b x tokens x vocabulary; 512 MB in fp32): 48 SmolLM2 rows of
# 1,024 tokens at once were [48, 1024, 49152] in bf16, then twice that in fp32 for the loss and entropy (OOM at 24 GB)
MAX_CHUNK_LOGITS = 1 << 27


def loss_and_entropy(logits: torch.Tensor, targets: torch.Tensor, entropy: bool = True):
    """logits [b, q, V] (any dtype), targets [b, q] -> (nll [b, q], entropy [b, q] or None) in fp32."""
    if not entropy:  # one pass over the vocabulary instead of a materialised log-softmax
        x = logits.float()
        return torch.logsumexp(x, -1) - x.gather(-1, targets.unsqueeze(-1)).squeeze(-1), None
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return nll, ent


@dataclasses.dataclass
class RolloutResult:
    token_loss: torch.Tensor  # [b, S]
    token_entropy: torch.Tensor  # [b, S]
    mean_held: float  # pairs held per (layer, sequence, KV head) when a token attends, averaged over the real tokens
    peak_slots: int
    held_per_row: torch.Tensor  # [b] the same over each row's real (not padding) tokens
    held_per_token: torch.Tensor  # [b, S] the pairs each token's query saw (its own included; 0 for padding)


def make_cache(model, policy, settings: EvictionSettings | None, prompt_len: int | None = None, recorder=None,
               generator: torch.Generator | None = None):
    """The cache the drivers use: transformers' ``DynamicCache`` for ``policy=None`` (the full cache), else a
    :class:`BoundedCache`."""
    if policy is None:
        return DynamicCache()
    return BoundedCache(model.config, policy, settings, prompt_len=prompt_len, recorder=recorder, generator=generator)


@functools.lru_cache(maxsize=64)
def last_position(q: int, device) -> torch.Tensor:
    """``logits_to_keep`` for the last of ``q`` positions, as an index tensor rather than the int 1: transformers
    slices the hidden states with it before the vocabulary projection, and the int's slice is a non-contiguous
    [b, 1, d] view, for which ``torch.matmul`` broadcasts the [V, d] weight to [b, d, V] and copies it (66 rows of
    SmolLM2 in bfloat16: a 3.7 GB copy and 8.9 s on 2 cores, against 0.02 s). Indexing with a tensor gathers a
    contiguous [b, 1, d]; the logits are the same. Kept per (q, device): no host-to-device copy per chunk, and a
    recorded chunk's index stays the tensor it was recorded with. Read-only."""
    return torch.tensor([q - 1], device=device)


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How :func:`forward_chunks` feeds its rows.

    ``chunk``: a full cache's tokens per chunk (a bounded cache's chunks end at its eviction points). ``logits_from``:
    a chunk that ends at or before this position yields only its last position's logits (a prefill). ``step``:
    ``"graph"`` (bounded caches) records the chunks that repeat once and replays them; ``None``: the model's
    (:func:`foresight.engine.recorded.set_model_step`). ``start``: the first token to feed (a cache forked after a
    shared prefix, :mod:`foresight.engine.cache.fork`). ``before_eviction``: stop where the next chunk would evict
    (a bounded cache's prefix pass)."""

    chunk: int = 1024
    logits_from: int = 0
    step: str | None = None
    start: int = 0
    before_eviction: bool = False


def forward_chunks(model, cache, input_ids: torch.Tensor, mask: torch.Tensor, how: Chunking = Chunking()):
    """Feed ``input_ids`` [b, S] (``mask`` bool [b, S], False = left padding) through ``model`` in chunks: up to
    each eviction point of a :class:`BoundedCache`, ``how.chunk`` tokens at a time for a full cache. Yields
    ``(start, end, logits [b, end - start, V])``; a chunk that ends at or before ``how.logits_from`` yields only its
    last position's logits ``[b, 1, V]`` (a prefill: the vocabulary projection of one position per row).

    ``how.step="graph"`` (bounded caches): chunks that repeat (same size, slots and layout: every chunk after the
    first eviction) are recorded once and replayed (:class:`~foresight.engine.recorded.RecordedChunks`); their logits
    are then a buffer the next chunk overwrites. The other fields: see :class:`Chunking`."""
    chunk, logits_from, before_eviction = how.chunk, how.logits_from, how.before_eviction
    step = model_step(model, how.step)
    S = input_ids.shape[1]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    bounded = isinstance(cache, BoundedCache)
    recorded = RecordedChunks(model, cache, capture_for(input_ids.device)) if bounded and step == "graph" else None
    all_real = bounded and bool(mask.all())  # checked once here, not by the cache on every chunk
    s = how.start
    while s < S and not (before_eviction and cache.slots is not None and cache.scheduled >= cache.capacity):
        q = cache.next_chunk(S - s) if bounded else min(chunk, S - s)
        kw = cache.feed(mask[:, s:s + q], all_real) if bounded else {"attention_mask": mask[:, : s + q].long()}
        extra = {"logits_to_keep": last_position(q, input_ids.device)} if s + q <= logits_from else {}
        if recorded is not None:
            logits = recorded.forward(input_ids[:, s:s + q], positions[:, s:s + q], {**kw, **extra})
        else:
            logits = model(input_ids=input_ids[:, s:s + q], position_ids=positions[:, s:s + q],
                           use_cache=True, **cache_kwargs(model, cache), **kw, **extra).logits
        yield s, s + q, logits
        s += q


@dataclasses.dataclass
class _Progress:
    """A teacher-forced pass's running results: per-token losses and entropies [b, S] so far, the last fed position's
    logits [b, 1, V] (they predict the next chunk's first token) and the pairs each fed token's query saw."""

    loss: torch.Tensor
    ent: torch.Tensor
    prev_logits: torch.Tensor | None
    held: torch.Tensor  # [b, S] float

    @classmethod
    def empty(cls, b: int, S: int, dev) -> "_Progress":
        return cls(torch.zeros(b, S, device=dev), torch.zeros(b, S, device=dev), None, torch.zeros(b, S, device=dev))

    def repeat(self, k: int) -> "_Progress":
        """A copy with each row repeated ``k`` times in place."""
        rep = lambda t: None if t is None else t.repeat_interleave(k, dim=0)  # noqa: E731 (a copy also for k = 1)
        return _Progress(rep(self.loss), rep(self.ent), rep(self.prev_logits), rep(self.held))


@dataclasses.dataclass
class Prefix:
    """A bounded rollout stopped where its first eviction would run (:func:`shared_prefix`): its cache, to fork for
    each policy (:func:`foresight.engine.cache.fork.fork`), its results so far and the rows it was fed."""

    cache: BoundedCache
    progress: _Progress
    ids: torch.Tensor  # [rows, S]
    mask: torch.Tensor  # [rows, S] bool
    entropy: bool  # whether the token entropies were computed (where the full cache's were not given)

    @property
    def end(self) -> int:
        """Tokens fed."""
        return self.cache.seen


def _feed(model, cache, input_ids, mask, how: Chunking, prog: _Progress, full, entropy: bool) -> int:
    """Teacher-force ``input_ids`` from ``how.start`` (to the end, or to the first eviction) into ``prog``; returns
    the tokens fed by then. Positions up to ``how.logits_from`` take the full cache's values ``full``; ``how.step``
    is the model's step, already resolved."""
    bounded = isinstance(cache, BoundedCache)
    known, step = how.logits_from, how.step
    end = how.start
    for s, end, logits in forward_chunks(model, cache, input_ids, mask, how):
        q = end - s
        if end <= known:  # before any eviction: the full cache's values
            prog.loss[:, s:end], prog.ent[:, s:end] = full[0][:, s:end], full[1][:, s:end]
        elif prog.prev_logits is not None:  # the previous chunk's last position predicts this chunk's first token
            logits_t = torch.cat([prog.prev_logits, logits[:, :-1]], dim=1)
            nll, h = loss_and_entropy(logits_t, input_ids[:, s:s + q], entropy)
            prog.loss[:, s:s + q] = nll
            if h is not None:
                prog.ent[:, s:s + q] = h
        else:
            nll, h = loss_and_entropy(logits[:, :-1], input_ids[:, s + 1:s + q], entropy)
            prog.loss[:, s + 1:s + q] = nll
            if h is not None:
                prog.ent[:, s + 1:s + q] = h
        prog.prev_logits = logits[:, -1:] if step == "eager" else logits[:, -1:].clone()  # a recording's buffer
        # every head gains one pair per token of the chunk (evictions come before its first): a row's k-th real token
        # of the chunk saw the pairs held before the chunk plus k
        held = cache.mean_held() if bounded else end
        prog.held[:, s:end] = (held - q) + mask[:, s:end].cumsum(1)
    return end


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """How :func:`rollout` runs, beyond the rows, the policy and its settings.

    ``generator``: seeds the eviction sampler and random policies. ``chunk``: the full cache's tokens per chunk
    (``policy=None``; fewer where the logits' memory demands it). ``full``: the full cache's (token_loss,
    token_entropy) of the same rows, when known (evaluation): no eviction happens before B + L tokens (the cache's
    capacity is at least that), so those positions take the full cache's values and skip the vocabulary projection.
    ``entropy=False``: only the losses (token_entropy is zero past those positions). ``step="graph"``: the chunks
    after the first eviction are recorded once and replayed (see :func:`forward_chunks`; ``None``: the model's, eager
    unless ``load_model`` was given ``model.step``); the results are bit-identical. ``prefix``: a
    :func:`shared_prefix` of these rows (each repeated ``b / rows`` times in place) under the same settings: the
    rollout continues from a fork of its cache instead of from token 0 (the same results when the prefix ran the
    policy's attention path, bit for bit where the batch is the prefix's).

    :func:`shared_prefix` reads ``full``, ``entropy`` and ``step`` only, and refuses a ``generator`` or a ``prefix``."""

    generator: torch.Generator | None = None
    chunk: int = 1024
    full: tuple | None = None
    entropy: bool = True
    step: str | None = None
    prefix: Prefix | None = None


@torch.no_grad()
def shared_prefix(model, input_ids: torch.Tensor, settings: EvictionSettings, prompt_len: int | None = None,
                  attention_mask: torch.Tensor | None = None, probabilities: bool = True,
                  options: RolloutOptions = RolloutOptions()) -> Prefix:
    """The part of a bounded rollout that is the same for every policy under ``settings``: ``input_ids`` fed up to
    the first eviction (``B + L`` tokens, plus a protected prompt), for :func:`rollout`'s ``prefix`` to continue from.
    ``probabilities``: for policies that read attention statistics accumulated from the probabilities (or that record
    their steps), else for those that read none or only the window sums (:mod:`foresight.engine.cache.fork`); the other
    arguments as :func:`rollout`'s (of ``options``: ``full``, ``entropy`` and ``step``)."""
    if options.generator is not None or options.prefix is not None:
        raise ValueError("shared_prefix: a shared prefix runs no policy: no generator and no prefix of its own")
    full, entropy = options.full, options.entropy
    step = model_step(model, options.step)
    mask = _mask(input_ids, attention_mask)
    cache = BoundedCache(model.config, PrefixPolicy(probabilities), settings, prompt_len=prompt_len)
    prog = _Progress.empty(*input_ids.shape, input_ids.device)
    known = cache.min_budget + settings.interval if full is not None else 0  # no eviction before
    end = _feed(model, cache, input_ids, mask, Chunking(0, known, step, before_eviction=True), prog, full, entropy)
    return Prefix(cache, prog, input_ids, mask, entropy or end <= known)


def _mask(input_ids, attention_mask):
    return torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()


@torch.no_grad()
def rollout(model, input_ids: torch.Tensor, policy=None, settings: EvictionSettings | None = None,
            prompt_len: int | None = None, attention_mask: torch.Tensor | None = None, recorder=None,
            options: RolloutOptions = RolloutOptions()) -> RolloutResult:
    """Teacher-force ``input_ids`` [b, S] (``attention_mask``: 0 = left padding) through ``model`` with a bounded
    cache evicting by ``policy`` under ``settings`` (``policy=None``: the full cache, in chunks of
    ``options.chunk``).

    ``prompt_len``: for ``settings.protect_prompt``. ``recorder(step_dict)`` is called at every eviction (see
    :meth:`BoundedCache.evict`). ``options``: the generator, the full cache's values when known, losses only, the
    step and a shared prefix to continue from (:class:`RolloutOptions`).
    """
    generator, chunk, full, entropy, prefix = (options.generator, options.chunk, options.full, options.entropy,
                                               options.prefix)
    step = model_step(model, options.step)
    b, S = input_ids.shape
    dev = input_ids.device
    if policy is None:  # a full-cache pass: chunks no larger than the logits' memory allows
        chunk = max(1, min(chunk, MAX_CHUNK_LOGITS // (b * model.config.vocab_size)))
    attention_mask = _mask(input_ids, attention_mask)
    start = 0
    if prefix is not None:
        repeat = _check_prefix(prefix, input_ids, attention_mask, policy, entropy)
        cache = fork(prefix.cache, policy, settings, generator, recorder, repeat)
        prog, start = prefix.progress.repeat(repeat), prefix.end
    else:
        cache = make_cache(model, policy, settings, prompt_len, recorder, generator)
        prog = _Progress.empty(b, S, dev)
    known = cache.min_budget + settings.interval if (full is not None and policy is not None) else 0  # no eviction before
    _feed(model, cache, input_ids, attention_mask, Chunking(chunk, known, step, start), prog, full, entropy)
    loss, ent = prog.loss, prog.ent
    held = prog.held * attention_mask
    valid = attention_mask.clone()
    valid[:, 1:] &= attention_mask[:, :-1]  # a token predicted from padding alone does not count
    valid[:, 0] = False
    loss, ent = loss * valid, ent * valid
    peak = cache.peak_slots if policy is not None else S
    real = attention_mask.sum(1)
    return RolloutResult(loss, ent, (held.sum() / real.sum().clamp(min=1)).item(), peak,
                         held.sum(1) / real.clamp(min=1), held)


def _check_prefix(prefix: Prefix, input_ids, mask, policy, entropy: bool) -> int:
    """How many times each of the prefix's rows repeats in ``input_ids``; an error if they are not its rows."""
    rows, b = prefix.ids.shape[0], input_ids.shape[0]
    repeat = b // rows
    if policy is None or b != rows * repeat or input_ids.shape[1] != prefix.ids.shape[1] or not (
            torch.equal(input_ids[::repeat], prefix.ids) and torch.equal(mask[::repeat], prefix.mask)):
        raise ValueError(f"rollout: the prefix was fed {tuple(prefix.ids.shape)} other rows than these "
                         f"{tuple(input_ids.shape)} (each of its rows, repeated in place) or there is no policy")
    if entropy and not prefix.entropy:
        raise ValueError("rollout: entropies requested, but the shared prefix computed only the losses")
    return repeat
