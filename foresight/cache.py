"""The bounded KV cache: every (sequence, layer, KV head) keeps at most B pairs (+ L new ones between evictions).

A :class:`BoundedCache` is a transformers :class:`~transformers.Cache`: any model whose attention goes through
``cache.update(...)`` and transformers' attention registry (Qwen3, Qwen2, Llama, ...) uses it unchanged once its
attention implementation is ``"foresight"`` (:mod:`foresight.attention`, which hands each attention call whose keys
came from this cache back to :meth:`BoundedCache.attend` through :func:`claim_attention`).

Layout: one dense tensor for keys and values of all layers, ``kv[2, layer, batch, kv_head, slot, head_dim]`` with
``capacity = protected prompt + B + L`` slots, so memory is really bounded, not masked. Keys are stored after RoPE.
Slots stay sorted by time; ``token[layer, batch, kv_head, slot]`` holds each pair's token index (position in the fed
sequence, pads included; ``-1`` for pads and empty slots) and attention is causal by it
(:mod:`foresight.slot_attention`). The statistics a policy reads are accumulated by a
:class:`~foresight.statistics.SlotStatistics`; policies see an :class:`~foresight.view.EvictionView`.

Eviction: when an update would overflow the capacity, ``L`` pairs per (layer, sequence, KV head) are dropped (more
after one oversized chunk) so that ``B`` remain besides the protected prompt. Protected: the newest ``window``
tokens (default ``interval``, the paper's scheme; KVpop brings its own), the first ``sinks`` real tokens and, with
``protect_prompt``, the prompt. A :class:`~foresight.policies.base.Policy` scores the candidates of all layers in one
call (higher = evict first); :mod:`foresight.selection` picks the slots (top-L or the Top-2L sampler); padding goes
first. A stateful policy may define ``observe(cache, layer, first_new_slot, count)`` to see new pairs as they arrive
and keep per-slot values in :meth:`BoundedCache.slot_tensor` (gathered with the kept slots).
"""

from __future__ import annotations

import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from foresight import features
from foresight.selection import sample_top2l, select_topk
from foresight.slot_attention import FusedMasks, probabilities
from foresight.statistics import ALL_ACCUMULATIONS, PROB_ACCUMULATIONS, WINDOW_KEYS, SlotStatistics, accumulations
from foresight.view import EvictionView, LazyStats, candidates

_handoff = threading.local()


def claim_attention(key: torch.Tensor):
    """``(cache, layer)`` when ``key`` is the tensor a :class:`BoundedCache` just returned from ``update`` (the
    attention call of that layer is then the cache's to compute, once); otherwise None."""
    state = getattr(_handoff, "state", None)
    if state is None or state[2] is not key:
        return None
    _handoff.state = None
    return state[0], state[1]


def validate_budget(budget: int, interval: int, sinks: int = 0, window: int | None = None) -> None:
    """Refuse impossible settings with a message that names the problem."""
    if budget <= 0:
        raise ValueError(f"cache budget must be > 0, got {budget}")
    if interval <= 0:
        raise ValueError(f"eviction interval must be > 0, got {interval}")
    if interval >= budget:
        raise ValueError(f"eviction interval L={interval} must be smaller than the budget B={budget}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    if window is None and budget < sinks + interval:
        raise ValueError(f"budget B={budget} must be at least sinks + interval = {sinks} + {interval}")
    if window is not None:
        if window < 0:
            raise ValueError(f"protected window must be >= 0, got {window}")
        if budget < sinks + window:
            raise ValueError(f"budget B={budget} must be at least sinks + window = {sinks} + {window}")


class _LayerHandle(CacheLayerMixin):
    """A per-layer facade so transformers' generic code (is_sliding, get_seq_length...) sees a normal cache."""

    is_sliding = False
    is_compileable = False

    def __init__(self, parent: "BoundedCache", idx: int):
        super().__init__()
        self.parent, self.idx = parent, idx

    def lazy_initialization(self, key_states, value_states):  # storage lives in the parent
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.parent.update(key_states, value_states, self.idx)

    def get_mask_sizes(self, query_length: int):
        return self.parent.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.parent.seen

    def get_max_length(self) -> int:
        return -1


class BoundedCache(Cache):
    """A KV cache of at most ``budget`` (+ ``interval``) pairs per (sequence, layer, KV head).

    Args:
        config: the model's config (layers, heads, head dim are read from it).
        policy: a :class:`~foresight.policies.base.Policy`; ``None`` means never evict (full cache).
        budget, interval, sinks: B, L and the number of protected first tokens.
        window: the newest ``window`` tokens are protected (default: the policy's ``layout_window`` attribute if it
            has one, e.g. KVpop's, else ``interval``, the paper's scheme).
        protect_prompt: keep the first ``prompt_len`` tokens (the prompt, padding included) forever; the budget
            applies to the rest.
        selection: ``"topk"`` or ``"sample"`` (Top-2L sampler); ``temperature`` for the sampler.
        recorder: optional callable receiving a dict per eviction step (see :meth:`evict`).
        generator: torch.Generator for the sampler and random policies (seeded runs).
    """

    def __init__(self, config, policy=None, budget: int | None = None, interval: int | None = None, sinks: int = 0,
                 protect_prompt: bool = False, prompt_len: int | None = None, selection: str = "topk",
                 temperature: float = 1.0, recorder=None, generator: torch.Generator | None = None,
                 prompt_overflow: str = "error", window: int | None = None):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._text_config = text
        self.num_layers = text.num_hidden_layers
        self.q_heads = text.num_attention_heads
        self.kv_heads = getattr(text, "num_key_value_heads", None) or self.q_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.q_heads
        self.group = self.q_heads // self.kv_heads
        self.full = policy is None
        if window is None:  # a policy with its own layout (KVpop) brings its window and sinks
            window = getattr(policy, "layout_window", None)
        sinks = max(sinks, getattr(policy, "layout_sinks", 0) or 0)
        if not self.full:
            validate_budget(budget, interval, sinks, window)
        self.window = interval if window is None else window
        if selection not in ("topk", "sample"):
            raise ValueError(f"selection must be 'topk' or 'sample', got {selection!r}")
        if prompt_overflow not in ("error", "evict"):
            raise ValueError(f"prompt_overflow must be 'error' or 'evict', got {prompt_overflow!r}")
        self.policy, self.budget, self.interval, self.sinks = policy, budget, interval, sinks
        self.protect_prompt, self.prompt_len = protect_prompt, prompt_len
        self.selection, self.temperature, self.recorder, self.generator = selection, temperature, recorder, generator
        self.prompt_overflow = prompt_overflow
        accumulations(getattr(policy, "reads", None))  # an unknown statistic fails here, not mid-rollout
        super().__init__(layers=[_LayerHandle(self, i) for i in range(self.num_layers)])
        self.n = 0  # slots in use (same for every row, layer and head)
        self.seen = 0  # tokens fed so far
        self.steps = 0  # evictions done
        self.kv = self.keys = self.values = self.token = None  # storage, allocated by the first update
        self.stats: SlotStatistics | None = None  # what the policy reads, accumulated (allocated with the storage)
        self.padded = False  # some fed token was padding (then attention masks are built in full)
        self._pending_valid = None
        self._fused_masks = FusedMasks()
        self._chunk = None  # (n_old, q, valid[b, q]) of the forward in progress
        self.peak_slots = 0
        self.scaling = self.head_dim ** -0.5  # the attention's softmax scale (the model's, once attend has run)
        self.slot_data: dict[str, torch.Tensor] = {}  # per-slot tensors of stateful policies, kept in step
        self.policy_state: dict = {}  # anything else a stateful policy carries (e.g. a recurrent memory)

    # ----------------------------------------------------------------------------------------------- set-up
    def feed(self, valid: torch.Tensor) -> dict:
        """Tell the cache which of the next forward's tokens are real (``[b, q]`` bool; False = padding).

        Returns the keyword arguments for that forward: a 4-D placeholder ``attention_mask`` ``[b, 1, q, 0]``.
        The cache's attention builds its own masks from token indices, so transformers need not build a causal
        mask (a 4-D mask is passed through as is; building one costs ~3% of a rollout). The placeholder is empty:
        an attention function that tried to use it would fail on its shape rather than attend without a mask."""
        impl = getattr(self._text_config, "_attn_implementation", None)
        if impl is not None and impl != "foresight":
            raise ValueError(f"BoundedCache: the model's attention implementation is {impl!r}, not 'foresight': load "
                             "it with foresight.models.load_model or call foresight.attention.use_foresight_attention")
        self._pending_valid = valid
        b, q = valid.shape
        return {"attention_mask": torch.empty(b, 1, q, 0, dtype=torch.bool, device=valid.device)}

    @property
    def needs(self) -> frozenset:
        """What is accumulated for the policy (every statistic until the storage is allocated)."""
        return ALL_ACCUMULATIONS if self.stats is None else self.stats.needs

    @property
    def chunk_valid(self) -> torch.Tensor:
        """``[b, q]``: which tokens of the forward in progress are real (for stateful policies' ``observe``)."""
        return self._chunk[2]

    @property
    def protected_prefix(self) -> int:
        return self.prompt_len if (self.protect_prompt and self.prompt_len) else 0

    @property
    def capacity(self) -> int:
        if self.full:
            return 0
        return self.protected_prefix + self.budget + self.interval

    @property
    def target(self) -> int:
        return self.protected_prefix + self.budget

    def next_chunk(self, remaining: int) -> int:
        """Largest chunk the drivers may feed next: ends at the next eviction point or block start."""
        if self.full:
            return remaining
        room = self.capacity - self.n
        if room <= 0:  # an eviction happens first
            room = self.capacity - self.target
        stop = room
        block_start = self.target - self.n  # tokens until the block before the first eviction starts
        if 0 < block_start < stop:
            stop = block_start
        return max(1, min(remaining, stop, self.interval))

    def _allocate(self, key_states: torch.Tensor):
        b, dev, dt = key_states.shape[0], key_states.device, key_states.dtype
        if self.protect_prompt and self.prompt_len is None:
            self.prompt_len = key_states.shape[-2]  # the first forward is the prompt (transformers' generate)
        if not self.full and self.protect_prompt and self.prompt_len > self.budget and self.prompt_overflow == "error":
            raise ValueError(
                f"protect_prompt: the prompt has {self.prompt_len} tokens, more than the budget B={self.budget}; "
                "raise the budget or set cache.prompt_overflow=evict to evict inside the prompt")
        if self.protect_prompt and not self.full and self.prompt_len > self.budget:
            self.protect_prompt = False  # prompt_overflow=evict: fall back to normal eviction of the prompt
        # only what the policy reads is accumulated; everything for a full cache or when steps are recorded
        reads = None if (self.full or self.recorder is not None) else getattr(self.policy, "reads", None)
        cap = max(self.capacity, key_states.shape[-2], 1) if not self.full else max(key_states.shape[-2], 64)
        nl, h, d = self.num_layers, self.kv_heads, self.head_dim
        # one buffer for keys and values: eviction gathers them in one call
        self.kv = torch.zeros(2, nl, b, h, cap, d, device=dev, dtype=dt)
        self.keys, self.values = self.kv[0], self.kv[1]
        self.token = torch.full((nl, b, h, cap), -1, device=dev, dtype=torch.long)
        self.stats = SlotStatistics(accumulations(reads), nl, b, h, self.q_heads, d, cap,
                                    pending=max(self.interval or 1, features.QUERY_WINDOW), device=dev, dtype=dt)
        self.first_real = torch.full((b,), -1, device=dev, dtype=torch.long)
        self._all_started = False

    def slot_tensor(self, name: str, fill: float = 0.0) -> torch.Tensor:
        """A per-slot float tensor ``[nl, b, h, capacity]`` owned by a policy; eviction gathers it with the kept
        slots, like the keys (created on first use)."""
        if name not in self.slot_data:
            self.slot_data[name] = torch.full(self.token.shape, fill, dtype=torch.float32, device=self.token.device)
        return self.slot_data[name]

    def _grow(self, need: int):
        """Only an oversized chunk (e.g. transformers' one-shot prefill of a long prompt) or the full cache grows."""
        cap = self.keys.shape[3]
        if need <= cap:
            return
        extra = max(need, 2 * cap if self.full else need) - cap

        def ext(t, dim, fill):
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)

        self.kv = ext(self.kv, 4, 0)
        self.keys, self.values = self.kv[0], self.kv[1]
        self.token = ext(self.token, 3, -1)
        self.stats.grow(extra)
        for name, t in self.slot_data.items():
            self.slot_data[name] = ext(t, 3, 0.0)

    # ----------------------------------------------------------------------------------------------- update
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        q = key_states.shape[-2]
        if layer_idx == 0:
            self._begin_chunk(key_states, q)
        n_old = self._chunk[0]
        self.keys[layer_idx, :, :, n_old:n_old + q] = key_states
        self.values[layer_idx, :, :, n_old:n_old + q] = value_states
        k_view = self.keys[layer_idx, :, :, :n_old + q]
        v_view = self.values[layer_idx, :, :, :n_old + q]
        observe = getattr(self.policy, "observe", None)  # a stateful policy sees every new pair as it arrives
        if observe is not None:
            observe(self, layer_idx, n_old, q)
        _handoff.state = (self, layer_idx, k_view)
        return k_view, v_view

    def _begin_chunk(self, key_states, q: int):
        if self._chunk is not None:
            raise RuntimeError("BoundedCache: the previous forward never reached the 'foresight' attention function; "
                               "load the model with attn_implementation='foresight' "
                               "(foresight.attention.use_foresight_attention)")
        if self.keys is None:
            self._allocate(key_states)
        first_block = not self.full and self.steps == 0 and self.seen <= self.target < self.seen + q
        if self.stats.n_pending and (q > 1 or first_block):
            self._replay()  # deferred statistics go in before a chunk's own (query order) or a block reset
        if not self.full and self.n + q > self.capacity and self.n > self.target:
            self.evict(self.n - self.target)
        self._grow(self.n + q)
        b, dev = key_states.shape[0], key_states.device
        valid = self._pending_valid
        self._pending_valid = None
        if valid is None:
            valid = torch.ones(b, q, dtype=torch.bool, device=dev)
        else:
            valid = valid.to(dev)
            if not self.padded and not bool(valid.all()):
                self.padded = True
        self._chunk = (self.n, q, valid)
        if first_block:
            self.stats.reset_block(slice(0, self.n))  # the block before the first eviction starts here
        tok = torch.arange(self.seen, self.seen + q, device=dev)
        if not self._all_started:  # the first real token of each row (sinks are counted from it)
            new_first = (self.first_real < 0) & valid.any(1)
            self.first_real = torch.where(new_first, self.seen + valid.long().argmax(1), self.first_real)
            self._all_started = bool((self.first_real >= 0).all())
        tok_b = torch.where(valid, tok.unsqueeze(0), torch.full_like(tok.unsqueeze(0), -1))
        self.token[:, :, :, self.n:self.n + q] = tok_b[None, :, None, :]
        # slots >= n always hold clean statistics (allocation, growth and gathering keep them so)

    def _finish_chunk(self):
        n_old, q, _ = self._chunk
        self.n = n_old + q
        self.seen += q
        self.peak_slots = max(self.peak_slots, self.n)
        self._chunk = None

    # -------------------------------------------------------------------------------------------- attention
    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the new queries [b, Hq, q, d] (after RoPE) against this layer's slots; returns
        [b, q, Hq, d] like transformers' attention functions, and accumulates what the policy reads.

        A chunk (q > 1) computes the probabilities explicitly when a statistic needs them (fused SDPA otherwise).
        A decoding step (q = 1) runs fused SDPA and defers its query; the deferred queries are replayed in one
        batched pass when the statistics are next needed (before an eviction, a chunk or a block reset)."""
        n_old, q, valid = self._chunk
        n = n_old + q
        self.scaling = scaling
        K = self.keys[layer_idx, :, :, :n]
        V = self.values[layer_idx, :, :, :n]
        ktok = self.token[layer_idx, :, :, :n]  # [b, h, n]
        last = layer_idx == self.num_layers - 1
        if q == 1 and not self.full:
            out = torch.nn.functional.scaled_dot_product_attention(
                query, K, V, attn_mask=FusedMasks.decoding(ktok, self.group), scale=scaling, enable_gqa=True)
            full = self.needs and self.stats.defer(layer_idx, query, self.seen, valid)
            if last:
                self._finish_chunk()
                if full:
                    self._replay()
            return out.transpose(1, 2)
        qtok = torch.arange(self.seen, self.seen + q, device=query.device)
        if self.needs & PROB_ACCUMULATIONS:
            probs, hidden = probabilities(query, K, ktok, qtok, self.padded, True, scaling)
            # the g query heads of a KV head share its keys: one [g*q, n] x [n, d] product per KV head, no broadcast
            b, hq, _, d = query.shape
            out = torch.matmul(probs.to(V.dtype).view(b, self.kv_heads, -1, n), V).reshape(b, hq, q, d)
            self.stats.accumulate(layer_idx, probs, hidden, valid)
        else:  # no statistic needs the probabilities: fused attention
            mask = self._fused_masks.chunk(ktok, qtok, self.padded, self.group, self.keys.dtype)
            out = torch.nn.functional.scaled_dot_product_attention(query, K, V, attn_mask=mask, scale=scaling,
                                                                   enable_gqa=True)
        if "window" in self.needs:
            self.stats.remember_queries(layer_idx, query, qtok, valid)
        if last:
            self._finish_chunk()
        return out.transpose(1, 2)

    def _replay(self):
        self.stats.replay(self.keys, self.token, self.n, self.padded, self.scaling)

    # ---------------------------------------------------------------------------------------------- evict
    def _check_current(self, at: tuple):
        if at != (self.steps, self.seen):
            raise RuntimeError("this EvictionView is stale: the cache changed since it was made, so its lazily "
                               "computed statistics cannot be computed any more (use view.snapshot() to keep one)")

    def _window_stats(self, n: int, at: tuple) -> dict:
        self._check_current(at)
        return self.stats.window_stats(self.keys, self.token, n, self.padded, self.scaling)

    def _min_stat(self, n: int, at: tuple) -> dict:
        self._check_current(at)
        return {"min": self.stats.min_stat(n)}

    def view(self) -> EvictionView:
        """What the policy sees now (statistics of the current block; the window sums and ``min`` on demand)."""
        self._replay()
        n, need, at = self.n, self.needs, (self.steps, self.seen)
        lazy = []
        if "window" in need:
            lazy.append((WINDOW_KEYS, lambda: self._window_stats(n, at)))
        if "min" in need:
            lazy.append(({"min"}, lambda: self._min_stat(n, at)))
        missing = "" if need == ALL_ACCUMULATIONS else (
            f"policy {getattr(self.policy, 'name', self.policy)!r} declares reads="
            f"{sorted(self.policy.reads)} (Policy.reads), and the cache computes only those")
        tok = self.token[:, :, :, :n]
        evictable = candidates(tok, self.window, self.sinks, self.first_real, self.protected_prefix)
        return EvictionView(self.keys[:, :, :, :n], self.values[:, :, :, :n], tok,
                            LazyStats(self.stats.accumulated(n), lazy, missing), evictable, n_evict=0,
                            step=self.steps, seen=self.seen, prompt_len=self.prompt_len or 0,
                            generator=self.generator, slot={k: v[..., :n] for k, v in self.slot_data.items()})

    @torch.no_grad()
    def evict(self, n_evict: int):
        """Drop ``n_evict`` pairs per (layer, sequence, KV head); padding first, then by the policy's scores."""
        self._replay()
        n = self.n
        self.stats.end_block(n)
        view = self.view()
        view.n_evict = n_evict
        tok = view.token
        scores = self.policy.score(view).float()
        evictable = view.evictable
        if self.padded:  # padding slots go first (without padding, every slot below n holds a real token)
            pad = (tok < 0) & (torch.arange(n, device=tok.device) >= self.protected_prefix)
            scores = torch.where(pad, torch.full_like(scores, 1e30), scores)
            evictable = evictable | pad
        n_cand = int(evictable.sum(-1).min())
        if n_cand < n_evict:
            raise RuntimeError(f"only {n_cand} evictable pairs for {n_evict} evictions: B, L, sinks and the "
                               "protected prompt leave too little room")
        if self.selection == "sample":
            chosen = sample_top2l(scores, evictable, n_evict, self.temperature, self.generator)
        else:
            chosen = select_topk(scores, evictable, n_evict)
        drop = torch.zeros_like(evictable).scatter_(-1, chosen, True)
        order = (~drop).nonzero()[:, -1].view(*drop.shape[:-1], n - n_evict)  # kept slots, ascending per row
        if self.recorder is not None:
            self.recorder({"step": self.steps, "seen": self.seen, "token": tok.clone(), "chosen": chosen,
                           "scores": scores, "evictable": evictable, "view": view.snapshot()})
        self._gather(order)
        self.n = n - n_evict
        self.stats.reset_block(slice(0, self.n))
        self.steps += 1

    def _gather(self, order):
        """Keep the slots ``order`` ([nl,b,h,k], ascending) in every per-slot tensor."""
        k, n = order.shape[-1], self.n
        nl, b, h = order.shape[:3]
        idx_kv = order[None, ..., None].expand(2, nl, b, h, k, self.head_dim)
        self.kv[..., :k, :] = self.kv[..., :n, :].gather(4, idx_kv)
        self.token[..., :k] = self.token[..., :n].gather(3, order)
        self.stats.gather(order, n)
        for t in self.slot_data.values():
            t[..., :k] = t[..., :n].gather(3, order)
        self.token[..., k:] = -1

    # ----------------------------------------------------------------------------------- transformers API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.n + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.seen

    @property
    def max_batch_size(self):
        return None if self.keys is None else self.keys.shape[1]

    def cache_bytes(self) -> int:
        """Bytes of the allocated key/value storage."""
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def held(self) -> int:
        """Pairs held per (sequence, layer, KV head) right now."""
        return self.n
