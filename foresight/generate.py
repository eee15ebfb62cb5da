"""Generation under eviction: chunked prefill, then token-by-token decoding (greedy or sampling).

A prompt longer than the budget is consumed at most L tokens at a time with eviction in between, so peak
memory stays at ``B + L`` pairs per head (the primer's "prefill pitfall": prefilling the whole prompt first
would hold all of it). Batched generation takes left-padded prompts (``attention_mask`` 0 = padding).
``policy=None`` runs the plain full cache (transformers' ``DynamicCache`` and SDPA), the reference point.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import DynamicCache

from foresight.cache import BoundedCache


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of [b, V] logits (filtered entries become -inf)."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


@dataclasses.dataclass
class GenerationResult:
    sequences: torch.Tensor  # [b, P + new] prompt (as given) + generated tokens (pad after EOS)
    new_tokens: torch.Tensor  # [b, new]
    logprobs: torch.Tensor  # [b, new] log-probability of each generated token (under the unfiltered model)
    peak_slots: int
    cache: object


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 256,
             policy=None, budget: int | None = None, interval: int | None = None, sinks: int = 0,
             protect_prompt: bool = False, selection: str = "topk", temperature_evict: float = 1.0,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: int | None = None, pad_token_id: int = 0, generator: torch.Generator | None = None,
             prompt_overflow: str = "error", prefill_chunk: int = 1024, window: int | None = None) -> GenerationResult:
    b, P = input_ids.shape
    dev = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = attention_mask.bool()
    if policy is None:
        cache = DynamicCache()
    else:
        cache = BoundedCache(model.config, policy, budget, interval, sinks=sinks, protect_prompt=protect_prompt,
                             prompt_len=P, selection=selection, temperature=temperature_evict, generator=generator,
                             prompt_overflow=prompt_overflow, window=window)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    # ---- chunked prefill
    s, logits = 0, None
    while s < P:
        q = cache.next_chunk(P - s) if policy is not None else min(prefill_chunk, P - s)
        if policy is not None:
            kw = cache.feed(mask[:, s:s + q])
        else:
            kw = {"attention_mask": mask[:, : s + q].long()}
        logits = model(input_ids=input_ids[:, s:s + q], position_ids=positions[:, s:s + q], cache=cache,
                       use_cache=True, **kw).logits[:, -1]
        s += q
    next_pos = mask.long().sum(-1)  # position of the first generated token
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    new, lps = [], []
    full_mask = mask.long()
    for _ in range(max_new_tokens):
        lp_all = torch.log_softmax(logits.float(), dim=-1)
        if do_sample:
            filt = filter_logits(logits.float() / max(temperature, 1e-6), top_k, top_p)
            probs = filt.softmax(-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            tok = logits.argmax(-1)
        tok = torch.where(done, torch.full_like(tok, pad_token_id), tok)
        new.append(tok)
        lps.append(lp_all.gather(-1, tok[:, None]).squeeze(-1).masked_fill(done, 0.0))
        if eos_token_id is not None:
            done = done | (tok == eos_token_id)
        if bool(done.all()) or len(new) == max_new_tokens:
            break
        if policy is not None:
            kw = cache.feed(torch.ones(b, 1, dtype=torch.bool, device=dev))
        else:
            full_mask = torch.cat([full_mask, torch.ones(b, 1, dtype=full_mask.dtype, device=dev)], 1)
            kw = {"attention_mask": full_mask}
        logits = model(input_ids=tok[:, None], position_ids=next_pos[:, None], cache=cache, use_cache=True,
                       **kw).logits[:, -1]
        next_pos = next_pos + 1
    new_t = torch.stack(new, 1) if new else torch.zeros(b, 0, dtype=input_ids.dtype, device=dev)
    lp_t = torch.stack(lps, 1) if lps else torch.zeros(b, 0, device=dev)
    peak = cache.peak_slots if policy is not None else P + new_t.shape[1]
    return GenerationResult(torch.cat([input_ids, new_t], 1), new_t, lp_t, peak, cache)
