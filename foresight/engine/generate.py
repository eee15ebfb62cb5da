"""Generation under eviction: chunked prefill, then token-by-token decoding (greedy or sampling).

A prompt longer than the budget is consumed at most L tokens at a time with eviction in between, so peak
memory stays at ``B + L`` pairs per head (the primer's "prefill pitfall": prefilling the whole prompt first
would hold all of it). Batched generation takes left-padded prompts (``attention_mask`` 0 = padding).
``policy=None`` runs the plain full cache (:class:`~foresight.engine.cache.full.PreallocatedCache`, allocated once for prompt
plus new tokens, attending over the filled part only, and SDPA), the reference point.
"""

from __future__ import annotations

import dataclasses

import torch

from foresight.config.eviction import EvictionSettings
from foresight.engine.cache.full import PreallocatedCache
from foresight.engine.recorded import capture_for, model_step
from foresight.engine.rollout import Chunking, forward_chunks, make_cache
from foresight.engine.static_step import StaticDecoder
from foresight.engine.cache_keyword import cache_kwargs


EOS_CHECK_EVERY = 16  # tokens between checks that every row has stopped, on an accelerator


def eos_check_interval(device: torch.device) -> int:
    """How often generation asks whether every row has stopped: each token on a CPU (free there, and no step is
    wasted), every ``EOS_CHECK_EVERY`` tokens on an accelerator, where the question is a host sync that stalls the
    launch queue at every token. Steps run past the last EOS are trimmed away, so the result is the same."""
    return 1 if device.type == "cpu" else EOS_CHECK_EVERY


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of [b, V] logits (filtered entries become -inf)."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, _nucleus(sorted_logits, top_p))
    return logits


def _nucleus(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits sorted in descending order with everything past the smallest prefix whose mass reaches ``top_p`` set to
    -inf."""
    probs = sorted_logits.softmax(-1)
    return sorted_logits.masked_fill(probs.cumsum(-1) - probs > top_p, float("-inf"))


def sample_tokens(logits: torch.Tensor, decoding: "Decoding", generator=None, row_generators=None) -> torch.Tensor:
    """One token per row of [b, V] ``logits`` under ``decoding``'s temperature, top-k and top-p. With top-k the draw
    is among the k best tokens only (sorted by ``topk``; a sort of the whole vocabulary per row and step cost as
    much as the model's step on a small model); ``row_generators`` seed each row on its own."""
    scaled = logits.float() / max(decoding.temperature, 1e-6)
    k = decoding.top_k if 0 < decoding.top_k < scaled.shape[-1] else 0
    if k:
        vals, idx = scaled.topk(k, dim=-1)
        vals = _nucleus(vals, decoding.top_p) if decoding.top_p < 1.0 else vals
    else:
        vals, idx = filter_logits(scaled, 0, decoding.top_p), None
    probs = vals.softmax(-1)
    if row_generators is None:
        pick = torch.multinomial(probs, 1, generator=generator)
    else:
        pick = torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g) for i, g in enumerate(row_generators)])
    return (pick if idx is None else idx.gather(-1, pick)).squeeze(-1)


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How tokens are drawn: greedy, or sampled with temperature, top-k and top-p; when a row stops (EOS) and what
    pads it afterwards."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_id: int | None = None
    pad_token_id: int = 0
    min_tokens: int = 0  # EOS cannot be drawn before this many new tokens (vLLM's min_tokens)

    @classmethod
    def from_recipe(cls, traces, tokenizer, do_sample: bool | None = None) -> "Decoding":
        """The recipe's sampling settings (``traces`` section; ``do_sample`` overrides its own) and the tokenizer's
        EOS and padding tokens."""
        return cls(traces.do_sample if do_sample is None else do_sample, traces.temperature, traces.top_k,
                   traces.top_p, tokenizer.eos_token_id, tokenizer.pad_token_id, traces.min_tokens)

    def truncate(self, new: list[int]) -> list[int]:
        """A generated row up to and including its first EOS."""
        if self.eos_token_id is not None and self.eos_token_id in new:
            return new[: new.index(self.eos_token_id) + 1]
        return new


@dataclasses.dataclass
class GenerationResult:
    sequences: torch.Tensor  # [b, P + new] prompt (as given) + generated tokens (pad after EOS)
    new_tokens: torch.Tensor  # [b, new]
    logprobs: torch.Tensor  # [b, new] log-probability of each generated token (under the unfiltered model)
    peak_slots: int
    cache: object


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """How :func:`generate` runs, beyond the prompts, the policy, its settings and the decoding.

    ``generator``: seeds sampling, the eviction sampler and random policies. ``row_generators`` (one per row): seed
    each row's sampling on its own, so that a row's tokens do not depend on the rest of the batch.
    ``prefill_chunk``: the full cache's prompt tokens per prefill chunk (a bounded cache's chunks end at its eviction
    points). ``step``: how a bounded cache's decoding steps run: ``"eager"`` (default), ``"static"`` (the capturable
    step of :mod:`foresight.engine.static_step`: static shapes, positions on the device), ``"graph"`` (that step
    recorded once and replayed: a CUDA graph on CUDA, a ``torch.fx`` graph of its operations elsewhere). Static steps
    attend over the whole capacity, so their values equal the eager ones up to float rounding. ``None``: the model's
    (:func:`foresight.engine.recorded.set_model_step`; a full cache always decodes eagerly)."""

    generator: torch.Generator | None = None
    row_generators: list | None = None
    prefill_chunk: int = 1024
    step: str | None = None


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 256,
             policy=None, settings: EvictionSettings | None = None, decoding: Decoding = Decoding(),
             options: GenerateOptions = GenerateOptions()) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after the left-padded prompts ``input_ids`` [b, P] (``attention_mask``:
    0 = padding) with a bounded cache evicting by ``policy`` under ``settings`` (``policy=None``: the full cache,
    prefilled ``options.prefill_chunk`` tokens at a time). The prompt is protected with ``settings.protect_prompt``;
    ``decoding``: greedy or sampled, and when rows stop. ``options``: the generators, the prefill chunk and the
    decoding step (:class:`GenerateOptions`)."""
    generator, row_generators, step = options.generator, options.row_generators, options.step
    explicit = step is not None
    step = model_step(model, step)
    if step != "eager" and policy is None:
        if explicit:
            raise ValueError(f"generate: step={step!r} needs a bounded cache (a policy); the full cache decodes eagerly")
        step = "eager"
    if step != "eager" and not explicit and getattr(policy, "observe", None) is not None:
        step = "eager"  # a policy that observes every new pair on the host decodes eagerly (StaticStep refuses it)
    b, P = input_ids.shape
    dev = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = attention_mask.bool()
    if policy is None:  # the full cache, allocated once (a DynamicCache copies every layer at every token), attending
        cache = PreallocatedCache(model.config, P + max_new_tokens)  # over its filled part (a StaticCache: all of it)
    else:
        cache = make_cache(model, policy, settings, prompt_len=P, generator=generator)
    logits = None
    prefill = Chunking(options.prefill_chunk, logits_from=P, step="graph" if step == "graph" else "eager")
    for _, _, chunk_logits in forward_chunks(model, cache, input_ids, mask, prefill):
        logits = chunk_logits[:, -1]
    next_pos = mask.long().sum(-1)  # position of the first generated token
    decoder = None
    if step != "eager":
        decoder = StaticDecoder(model, cache, capture=None if step == "static" else capture_for(dev))
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    last_eos = torch.zeros(b, dtype=torch.long, device=dev)  # the step of each row's EOS (0 until it has one)
    check_every = eos_check_interval(dev)
    new, lps = [], []
    full_mask = mask.long()
    real = torch.ones(b, 1, dtype=torch.bool, device=dev)  # each decoding step's token is real (done rows' too)
    for _ in range(max_new_tokens):
        lp_all = torch.log_softmax(logits.float(), dim=-1)
        if len(new) < decoding.min_tokens and decoding.eos_token_id is not None:
            logits = logits.clone()
            logits[:, decoding.eos_token_id] = float("-inf")
        if decoding.do_sample:
            tok = sample_tokens(logits, decoding, generator, row_generators)
        else:
            tok = logits.argmax(-1)
        tok = torch.where(done, torch.full_like(tok, decoding.pad_token_id), tok)
        new.append(tok)
        lps.append(lp_all.gather(-1, tok[:, None]).squeeze(-1).masked_fill(done, 0.0))
        if decoding.eos_token_id is not None:
            last_eos = torch.where(done, last_eos, torch.full_like(last_eos, len(new)))
            done = done | (tok == decoding.eos_token_id)
            if len(new) % check_every == 0 and bool(done.all()):
                stop = int(last_eos.max())
                del new[stop:], lps[stop:]  # steps run after every row had stopped
                break
        if len(new) == max_new_tokens:
            break
        if decoder is not None:
            logits = decoder.step(tok, next_pos)
        else:
            if policy is not None:
                kw = cache.feed(real, all_real=True)
            else:
                full_mask = torch.cat([full_mask, torch.ones(b, 1, dtype=full_mask.dtype, device=dev)], 1)
                kw = {"attention_mask": full_mask}
            logits = model(input_ids=tok[:, None], position_ids=next_pos[:, None], use_cache=True,
                           **cache_kwargs(model, cache), **kw).logits[:, -1]
        next_pos = next_pos + 1
    new_t = torch.stack(new, 1) if new else torch.zeros(b, 0, dtype=input_ids.dtype, device=dev)
    lp_t = torch.stack(lps, 1) if lps else torch.zeros(b, 0, device=dev)
    peak = cache.peak_slots if policy is not None else P + new_t.shape[1]
    return GenerationResult(torch.cat([input_ids, new_t], 1), new_t, lp_t, peak, cache)
