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

import torch
from transformers import DynamicCache

from foresight.cache import BoundedCache


def loss_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, q, V] (any dtype), targets [b, q] -> (nll [b, q], entropy [b, q]) in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return nll, ent


@dataclasses.dataclass
class RolloutResult:
    token_loss: torch.Tensor  # [b, S]
    token_entropy: torch.Tensor  # [b, S]
    steps: list  # one dict per eviction step (what the cache's recorder saw), if recorded
    mean_held: float  # mean slots held per (layer, sequence, head) over the fed tokens
    peak_slots: int


@torch.no_grad()
def rollout(model, input_ids: torch.Tensor, policy=None, budget: int | None = None, interval: int | None = None,
            sinks: int = 0, protect_prompt: bool = False, prompt_len: int | None = None, selection: str = "topk",
            temperature: float = 1.0, generator: torch.Generator | None = None, recorder=None,
            chunk: int = 1024, attention_mask: torch.Tensor | None = None, prompt_overflow: str = "error",
            on_chunk=None, window: int | None = None) -> RolloutResult:
    """Teacher-force ``input_ids`` [b, S] through ``model`` with a bounded cache (``policy=None``: full cache).

    ``recorder(step_dict)`` is called at every eviction (see :meth:`BoundedCache.evict`). ``on_chunk(start,
    end)`` is called after each chunk (used by golden labels to know the cache state).
    """
    b, S = input_ids.shape
    dev = input_ids.device
    if policy is None:
        cache = DynamicCache()
    else:
        cache = BoundedCache(model.config, policy, budget, interval, sinks=sinks, protect_prompt=protect_prompt,
                             prompt_len=prompt_len, selection=selection, temperature=temperature,
                             recorder=recorder, generator=generator, prompt_overflow=prompt_overflow, window=window)
    loss = torch.zeros(b, S, device=dev)
    ent = torch.zeros(b, S, device=dev)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    attention_mask = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    prev_logits = None
    held_sum, s = 0.0, 0
    while s < S:
        q = cache.next_chunk(S - s) if policy is not None else min(chunk, S - s)
        if policy is not None:
            kw = cache.feed(attention_mask[:, s:s + q])
        else:
            kw = {"attention_mask": attention_mask[:, : s + q].long()}
        out = model(input_ids=input_ids[:, s:s + q], position_ids=positions[:, s:s + q], cache=cache,
                    use_cache=True, **kw)
        logits = out.logits
        if prev_logits is not None:  # the previous chunk's last position predicts this chunk's first token
            logits_t = torch.cat([prev_logits, logits[:, :-1]], dim=1)
            nll, h = loss_and_entropy(logits_t, input_ids[:, s:s + q])
            loss[:, s:s + q], ent[:, s:s + q] = nll, h
        else:
            nll, h = loss_and_entropy(logits[:, :-1], input_ids[:, s + 1:s + q])
            loss[:, s + 1:s + q], ent[:, s + 1:s + q] = nll, h
        prev_logits = logits[:, -1:]
        held = cache.n if policy is not None else s + q
        held_sum += held * q
        s += q
        if on_chunk is not None:
            on_chunk(s - q, s)
    valid = attention_mask.clone()
    valid[:, 1:] &= attention_mask[:, :-1]  # a token predicted from padding alone does not count
    valid[:, 0] = False
    loss, ent = loss * valid, ent * valid
    peak = cache.peak_slots if policy is not None else S
    return RolloutResult(loss, ent, [], held_sum / max(S, 1), peak)
