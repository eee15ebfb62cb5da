"""The bounded KV cache: every (sequence, layer, KV head) keeps at most B pairs (+ L new ones between evictions).

A :class:`BoundedCache` is a transformers :class:`~transformers.Cache`: any model whose attention goes through
``cache.update(...)`` and transformers' attention registry (Qwen3, Qwen2, Llama, ...) uses it unchanged once its
attention implementation is ``"foresight"`` (:mod:`foresight.engine.attention`, which hands each attention call whose keys
came from this cache back to :meth:`BoundedCache.attend`, see :mod:`foresight.engine.handoff`).

By composition: the slots (:class:`~foresight.engine.cache.slots.SlotStore`, ``protected prompt + B + L`` of them, so
memory is really bounded), attention causal by token index (:mod:`~foresight.engine.cache.slot_attention`), the statistics
the policy reads (:class:`~foresight.engine.cache.attention_stats.SlotStatistics`) and the policy's view
(:class:`~foresight.engine.view.EvictionView`); by job: the storage's allocation (:mod:`.storage`), each chunk's plan
(:mod:`.chunks`), the attention of its queries (:mod:`.attention`) and the eviction step (:mod:`foresight.engine.eviction`).

Eviction: when an update would overflow the capacity, ``L`` pairs per (layer, sequence, KV head) are dropped (more
after one oversized chunk) so that ``B`` remain besides the protected prompt (each layer its own ``B_l`` with
``cache.layer_budgets``: :mod:`foresight.engine.cache.layer_budgets`). Protected: the newest ``window``
tokens (default ``interval``, the paper's scheme; KVpop brings its own), the first ``sinks`` real tokens and, with
``protect_prompt``, the prompt. A :class:`~foresight.policies.base.Policy` scores the candidates of all layers in one
call (higher = evict first); :mod:`foresight.engine.selection` picks the slots (top-L or the Top-2L sampler); padding goes
first. A stateful policy may define ``observe(cache, layer, first_new_slot, count)`` (see :meth:`update`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from foresight.config.eviction import EvictionSettings
from foresight.engine import eviction, handoff
from foresight.engine.cache import attention as cache_attention, chunks as cache_chunks, layer_budgets, whole_heads
from foresight.engine.cache import storage as cache_storage
from foresight.engine.cache.layer_handle import LayerHandle
from foresight.engine.attention_shape import AttentionShape, text_config
from foresight.engine.cache.slot_attention import ChunkMasks
from foresight.engine.cache.slots import SlotStore
from foresight.engine.cache.attention_stats import ALL_ACCUMULATIONS, SlotStatistics, accumulations
from foresight.engine.view import EvictionView


class BoundedCache(Cache):
    """A KV cache of at most ``budget`` (+ ``interval``) pairs per (sequence, layer, KV head).

    ``config``: the model's; ``policy``: a :class:`~foresight.policies.base.Policy` (None: never evict);
    ``settings``: :class:`~foresight.config.eviction.EvictionSettings` (a policy with its own layout, KVpop's, brings its
    ``layout_window`` and at least its ``layout_sinks``); ``prompt_len``: for ``protect_prompt`` (default: the first
    forward's length); ``recorder``: called with a dict per eviction step (:meth:`evict`); ``generator``: seeds the
    sampler and random policies."""

    def __init__(self, config, policy=None, settings: EvictionSettings | None = None, prompt_len: int | None = None,
                 recorder=None, generator: torch.Generator | None = None):
        self._text_config = text_config(config)
        self.model_config = config  # for a fork (foresight.engine.cache.fork)
        shape = AttentionShape.of(config)
        self.num_layers, self.q_heads, self.kv_heads = shape.num_layers, shape.q_heads, shape.kv_heads
        self.head_dim, self.group = shape.head_dim, shape.group
        self.full = policy is None
        if settings is None:
            if not self.full:
                raise ValueError("BoundedCache: a policy needs EvictionSettings (budget, interval, ...)")
            settings = EvictionSettings()
        window = settings.window if settings.window is not None else getattr(policy, "layout_window", None)
        settings = settings.replace(sinks=max(settings.sinks, getattr(policy, "layout_sinks", 0) or 0), window=window)
        if not self.full:
            settings.validate()
        self.settings = settings  # as resolved for this cache (a policy's layout; the prompt-overflow fallback)
        self.resolved = settings  # the same before the storage's allocation may apply the prompt-overflow fallback
        self.window = settings.interval if window is None else window
        self.policy, self.prompt_len, self.recorder, self.generator = policy, prompt_len, recorder, generator
        self.whole_heads = [] if self.full else whole_heads.parse(settings.whole_heads)
        whole_heads.check_shape(self.whole_heads, self.num_layers, self.kv_heads)
        self.whole: whole_heads.WholeHeads | None = None  # every pair of the whole heads, from the first eviction
        self.layer_budget = None if self.full else layer_budgets.for_cache(settings, self.num_layers, self.window,
                                                                           recorder)  # None: every layer holds B
        self.smallest_layer = 0 if self.layer_budget is None else self.layer_budget.index(min(self.layer_budget))
        self.holes = [0] * self.num_layers  # per layer, slots below n that hold no pair (foresight.engine.cache.layer_budgets)
        accumulations(getattr(policy, "reads", None))  # an unknown statistic fails here, not mid-rollout
        super().__init__(layers=[LayerHandle(self, i) for i in range(self.num_layers)])
        self.n = 0  # slots in use (same for every row, layer and head)
        self.seen = 0  # tokens fed so far
        self.steps = 0  # evictions done
        self.slots: SlotStore | None = None  # keys, values, token indices: allocated by the first update
        self.stats: SlotStatistics | None = None  # what the policy reads, accumulated (allocated with the storage)
        self.padded = False  # some fed token was padding (then attention masks are built in full)
        self.pending_valid = None  # the validity given to feed() for the next forward
        self.masks = ChunkMasks()
        self._checked: set = set()  # (slots, evictions) whose candidate count was checked (unpadded)
        self.chunk: cache_chunks.Chunk | None = None  # the forward in progress
        self.layer_kv = None  # (layer, keys, values) of the layer whose update ran last
        self.peak_slots = 0
        self.scaling = self.head_dim ** -0.5  # the attention's softmax scale (the model's, once attend has run)
        self.policy_state: dict = {}  # anything else a stateful policy carries (e.g. a recurrent memory)
        self.static = None  # a foresight.engine.static_step.StaticStep while a static decoding step runs
        self.prepared = False  # the chunk in progress was planned by prepare_chunk (its caller finishes it)
        self.chunk_real = True  # no token of the chunk in progress is padding

    # ----------------------------------------------------------------------------------------------- set-up
    def feed(self, valid: torch.Tensor, all_real: bool = False) -> dict:
        """Tell the cache which of the next forward's tokens are real (``[b, q]`` bool; False = padding; ``all_real``:
        the caller knows none is padding, which spares a check per chunk). Returns that
        forward's keyword arguments: an empty 4-D placeholder ``attention_mask`` ``[b, 1, q, 0]``, which transformers
        passes through instead of building a causal mask (~3% of a rollout); the cache builds its own from token
        indices, and another attention function would fail on the shape rather than attend without a mask."""
        impl = getattr(self._text_config, "_attn_implementation", None)
        if impl is not None and impl != "foresight":
            raise ValueError(f"BoundedCache: the model's attention implementation is {impl!r}, not 'foresight': load "
                             "it with foresight.engine.models.load_model or call "
                             "foresight.engine.attention.use_foresight_attention")
        self.pending_valid = None if all_real else valid
        return {"attention_mask": self.masks.placeholder(*valid.shape, valid.device)}

    @property
    def needs(self) -> frozenset:
        """What is accumulated for the policy (every statistic until the storage is allocated)."""
        return ALL_ACCUMULATIONS if self.stats is None else self.stats.needs

    @property
    def chunk_valid(self) -> torch.Tensor:
        """``[b, q]``: which tokens of the forward in progress are real (for stateful policies' ``observe``)."""
        return self.chunk.valid

    @property
    def protected_prefix(self) -> int:
        return self.prompt_len if (self.settings.protect_prompt and self.prompt_len) else 0

    @property
    def min_budget(self) -> int:
        """The smallest layer's budget (B unless ``cache.layer_budgets``): evictions follow its schedule."""
        return self.settings.budget if self.layer_budget is None else min(self.layer_budget)

    @property
    def capacity(self) -> int:
        """Pairs the smallest layer holds before an eviction (the eviction schedule's; ``slot_capacity``: storage)."""
        if self.full:
            return 0
        return self.protected_prefix + self.min_budget + self.settings.interval

    @property
    def target(self) -> int:
        """Pairs the smallest layer holds after an eviction."""
        return self.protected_prefix + self.min_budget

    @property
    def slot_capacity(self) -> int:
        """Slots of storage: the largest layer's budget + L (the capacity without per-layer budgets)."""
        if self.layer_budget is None:
            return self.capacity
        return self.protected_prefix + max(self.layer_budget) + self.settings.interval

    @property
    def scheduled(self) -> int:
        """The smallest layer's pairs (slots in use less its holes): what the eviction schedule counts."""
        return self.n if self.layer_budget is None else self.n - self.holes[self.smallest_layer]

    def next_chunk(self, remaining: int) -> int:
        """Largest chunk the drivers may feed next: ends at the next eviction point or block start."""
        return cache_chunks.next_chunk(self, remaining)

    def accumulated(self) -> frozenset:
        """What this cache accumulates: what the policy reads; everything for a full cache or when steps are recorded."""
        return cache_storage.accumulated(self)

    @property
    def keys(self) -> torch.Tensor:  # [nl, b, h, capacity, d]
        return self.slots.keys

    @property
    def values(self) -> torch.Tensor:  # [nl, b, h, capacity, d]
        return self.slots.values

    @property
    def token(self) -> torch.Tensor:  # [nl, b, h, capacity]: token index per slot, -1 for pads and empty slots
        return self.slots.token

    def slot_tensor(self, name: str, fill: float = 0.0) -> torch.Tensor:
        """A per-slot float tensor ``[nl, b, h, capacity]`` owned by a stateful policy (see SlotStore.tensor)."""
        return self.slots.tensor(name, fill)

    def grow(self, need: int):
        """Only an oversized chunk (e.g. transformers' one-shot prefill of a long prompt) or the full cache grows."""
        cache_storage.grow(self, need)

    # ----------------------------------------------------------------------------------------------- update
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        q = key_states.shape[-2]
        if self.static is not None:  # a static decoding step: positions on the device, the whole capacity
            k_view, v_view = self.static.update(layer_idx, key_states, value_states)
            self.layer_kv = (layer_idx, k_view, v_view)
            handoff.offer(self, layer_idx, k_view)
            return k_view, v_view
        if layer_idx == 0:
            cache_chunks.write_tokens(self) if self.prepared else self._begin_chunk(key_states, q)
        n_old = self.chunk.start
        keys, values = self.slots.layer_keys[layer_idx], self.slots.layer_values[layer_idx]
        keys.narrow(2, n_old, q).copy_(key_states)
        values.narrow(2, n_old, q).copy_(value_states)
        if self.whole is not None and layer_idx in self.whole.by_layer:
            self.whole.append(layer_idx, key_states, value_states,
                              self.slots.layer_token[layer_idx].narrow(2, n_old, q))
        k_view, v_view = keys.narrow(2, 0, n_old + q), values.narrow(2, 0, n_old + q)
        self.layer_kv = (layer_idx, k_view, v_view)  # what attend() reads next
        observe = getattr(self.policy, "observe", None)  # a stateful policy sees every new pair as it arrives
        if observe is not None:
            observe(self, layer_idx, n_old, q)
        handoff.offer(self, layer_idx, k_view)
        return k_view, v_view

    def _begin_chunk(self, key_states, q: int):
        if self.chunk is not None:
            raise RuntimeError("BoundedCache: the previous forward never reached the 'foresight' attention function; "
                               "load the model with attn_implementation='foresight' "
                               "(foresight.engine.attention.use_foresight_attention)")
        if self.slots is None:
            cache_storage.allocate(self, key_states)
        cache_chunks.plan(self, q)
        cache_chunks.write_tokens(self)

    def prepare_chunk(self, q: int, tok_out: torch.Tensor, valid_out: torch.Tensor) -> None:
        """Everything a chunk of ``q`` tokens does on the host, before its forward (a recorded chunk,
        :mod:`foresight.engine.recorded`): replay, eviction, block reset, its token indices into ``tok_out`` [q] and (with
        padding) its validity into ``valid_out`` [b, q]. The forward then only writes the token indices, and the caller
        ends the chunk with :meth:`finish_prepared`."""
        if self.slots is None or self.chunk is not None:
            raise RuntimeError("BoundedCache.prepare_chunk: the storage is allocated by a first (eager) forward, and a "
                               "prepared chunk ends with finish_prepared()")
        if self.whole_heads:
            raise ValueError("cache.whole_heads: recorded chunks (model.step=graph) are not supported with whole heads "
                             "(their store grows); use model.step=eager")
        cache_chunks.plan(self, q, tok_out, valid_out)
        self.prepared = True

    def finish_prepared(self) -> None:
        self.prepared = False
        self.finish_chunk()

    def chunk_layout(self) -> tuple:
        """The host-visible state a prepared chunk's forward depends on besides its size (slots in use, padding):
        chunks with equal layouts run the same operations on the same buffers (foresight.engine.recorded)."""
        return self.n, self.padded, self.chunk_real, self.all_started

    def finish_chunk(self):
        """The forward in progress has run through every layer: its pairs count as held."""
        self.n = self.chunk.start + self.chunk.size
        self.seen += self.chunk.size
        self.peak_slots = max(self.peak_slots, self.n)
        self.chunk = None
        if self.whole is not None:
            self.whole.finish_chunk()

    # -------------------------------------------------------------------------------------------- attention
    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the new queries [b, Hq, q, d] (after RoPE) against this layer's slots; returns
        [b, q, Hq, d] like transformers' attention functions, and accumulates what the policy reads
        (:mod:`foresight.engine.cache.attention`)."""
        return cache_attention.attend(self, layer_idx, query, scaling)

    def replay_deferred(self):
        """The deferred decoding queries' statistics, computed now against the slots they saw (see ``attend``)."""
        self.stats.replay(self.keys, self.token, self.n, self.padded, self.scaling)

    # ---------------------------------------------------------------------------------------------- evict
    def view(self) -> EvictionView:
        """What the policy sees now (statistics of the current block; the window sums and ``min`` on demand)."""
        return eviction.current_view(self)

    def evict(self, n_evict: int):
        """Drop ``n_evict`` pairs per (layer, sequence, KV head); padding first, then by the policy's scores (the
        whole heads' pairs were copied aside at the first eviction: :mod:`foresight.engine.cache.whole_heads`)."""
        if self.whole_heads and self.whole is None:
            self.whole = whole_heads.WholeHeads.from_slots(self)
        eviction.evict(self, n_evict)

    # ----------------------------------------------------------------------------------- transformers API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.n + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.seen

    @property
    def max_batch_size(self):
        return None if self.slots is None else self.keys.shape[1]

    def cache_bytes(self) -> int:
        """Bytes of the allocated key/value storage (with the whole heads' store)."""
        return (0 if self.slots is None else self.slots.nbytes()) + (0 if self.whole is None else self.whole.nbytes())

    def held(self) -> int:
        """Slots in use per (sequence, layer, KV head) right now (with per-layer budgets, holes included)."""
        return self.n

    def mean_held(self) -> float:
        """Pairs held per (sequence, layer, KV head) on average over the heads (:func:`.storage.pairs_held`)."""
        return cache_storage.pairs_held(self)
