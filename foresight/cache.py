"""The bounded KV cache: every (sequence, layer, KV head) keeps at most B pairs (+ L new ones between evictions).

A :class:`BoundedCache` is a transformers :class:`~transformers.Cache`, so any model whose attention goes
through ``cache.update(...)`` and transformers' attention registry (Qwen3, Qwen2, Llama, ...) uses it
unchanged once its attention implementation is ``"foresight"`` (see :mod:`foresight.attention`).

Layout: one dense tensor per quantity for all layers, ``keys[layer, batch, kv_head, slot, head_dim]`` with
``capacity = protected_prompt + B + L`` slots, so memory is really bounded, not masked. Keys are stored after
RoPE: a kept key keeps its absolute position, queries keep their true positions. Slots stay sorted by time.
``token[layer, batch, kv_head, slot]`` holds the token index (0-based position in the fed sequence, pads
included) of the pair in each slot, ``-1`` for pads and empty slots; causality is
``token[key] <= token[query]``.

Eviction: when an update would overflow the capacity, ``L`` pairs per (layer, sequence, KV head) are dropped (more
when a single oversized chunk was appended) so that ``B`` remain besides the protected prompt. The newest
``window`` tokens (default ``interval``, the paper's scheme; KVpop sets its own window) are protected, so are the
first ``sinks`` real tokens and, with ``protect_prompt``, every prompt token. A
:class:`~foresight.policies.base.Policy` scores the candidates of all layers in one call (higher = evict first) and
:mod:`foresight.selection` picks the slots (top-L or the Top-2L sampler). Padding slots (left padding) are always
evicted first. A stateful policy (KVpop's mLSTM scorer) may define ``observe(cache, layer, first_new_slot,
count)``: it sees every new pair as it arrives and keeps per-slot values in :meth:`BoundedCache.slot_tensor`, which
eviction gathers with the kept slots.

Statistics (:mod:`foresight.features`) are accumulated only as far as the policy's ``reads`` asks (all of them when
it declares nothing or a recorder is attached); with none at all, chunks and decoding steps run fused SDPA.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from foresight import features as F
from foresight import selection

_active = threading.local()
_STAT_ORDER = ("sum", "max", "cum", "decay", "min")  # the per-slot statistics buffer (min last: it starts at +inf)
_CUM, _MIN = _STAT_ORDER.index("cum"), _STAT_ORDER.index("min")
# what the cache accumulates for each statistic a policy reads: block sums, maxima, minima, or the kept queries
_ACCUMULATION = {"sum": "sum", "cum": "sum", "decay": "sum", "max": "max", "min": "min"}  # else "window"
_ALL_ACCUMULATIONS = frozenset({"sum", "max", "min", "window"})
_PROB_ACCUMULATIONS = frozenset({"sum", "max", "min"})  # those that need each chunk's attention probabilities


_CAUSAL_BLOCKS: dict = {}


def causal_block(q: int, device) -> torch.Tensor:
    """[q, q] additive causal mask of the newest block of q queries over its own q keys: 0 where query i sees key j
    (j <= i), +inf above the diagonal (subtracted from scores, added to probabilities before a min); cached per
    (size, device). Shared by the cache's attention and the golden pass (foresight.attention)."""
    m = _CAUSAL_BLOCKS.get((q, device))
    if m is None:
        m = _CAUSAL_BLOCKS[(q, device)] = torch.full((q, q), float("inf"), device=device).triu(1)
    return m


def accumulations(reads) -> frozenset:
    """What the cache must accumulate for a policy reading the statistics ``reads`` (None: all of them)."""
    if reads is None:
        return _ALL_ACCUMULATIONS
    unknown = set(reads) - F.VIEW_STATS
    if unknown:
        raise ValueError(f"unknown attention statistics {sorted(unknown)}; known: {sorted(F.VIEW_STATS)}")
    return frozenset(_ACCUMULATION.get(r, "window") for r in reads)


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


class _Stats(dict):
    """The statistics of one eviction step. Some are computed only when a policy asks for one: the window sums
    (``w1``..``w32``, ``pivot32``, recomputed from the kept queries) and ``min`` (H2O, for instance, reads
    neither). ``lazy``: a list of (names, function returning a dict with those names). ``missing``: the message
    for a statistic the cache did not accumulate (the policy did not declare it)."""

    def __init__(self, base: dict, lazy: list, missing: str = ""):
        super().__init__(base)
        self._lazy = list(lazy)
        self._missing = missing

    def __missing__(self, key):
        for i, (names, fn) in enumerate(self._lazy):
            if key in names:
                self.update(fn())
                del self._lazy[i]
                return dict.__getitem__(self, key)
        if key in F.VIEW_STATS and self._missing:
            raise KeyError(f"attention statistic {key!r} was not computed: {self._missing}")
        raise KeyError(key)

    def materialize(self) -> "_Stats":
        for _, fn in self._lazy:
            self.update(fn())
        self._lazy = []
        return self


_WINDOW_KEYS = {f"w{w}" for w in F.WINDOWS} | {"pivot32"}


@dataclasses.dataclass
class EvictionView:
    """What a policy sees at one eviction step (all layers at once). Shapes use nl=layers, b=batch,
    h=KV heads, g=query heads per KV head, n=slots in use, d=head dim."""

    keys: torch.Tensor  # [nl, b, h, n, d]
    values: torch.Tensor  # [nl, b, h, n, d]
    token: torch.Tensor  # [nl, b, h, n] token index, -1 for pads
    stats: dict  # name -> [nl, b, h, g, n] (features.STAT_NAMES plus "w1")
    evictable: torch.Tensor  # [nl, b, h, n] candidates (not protected, not padding)
    n_evict: int
    step: int
    seen: int  # tokens fed so far
    prompt_len: int
    generator: torch.Generator | None = None
    slot: dict = dataclasses.field(default_factory=dict)  # name -> [nl, b, h, n]: per-slot data of stateful policies

    def snapshot(self) -> "EvictionView":
        """A copy that later cache updates cannot change (the cache's tensors are reused in place)."""
        return dataclasses.replace(self, keys=self.keys.clone(), values=self.values.clone(), token=self.token.clone(),
                                   stats={k: v.clone() for k, v in _materialized(self.stats).items()},
                                   evictable=self.evictable.clone(),
                                   slot={k: v.clone() for k, v in self.slot.items()})

    def attn_features(self) -> torch.Tensor:
        """[nl, b, h, n, 8*g]: the statistics in features.STAT_NAMES order, query heads innermost."""
        st = torch.stack([self.stats[k] for k in F.STAT_NAMES], dim=-1)  # [nl,b,h,g,n,8]
        return st.permute(0, 1, 2, 4, 5, 3).flatten(-2)


def _materialized(stats: dict) -> dict:
    return stats.materialize() if isinstance(stats, _Stats) else stats


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
        self.needs = _ALL_ACCUMULATIONS  # what is accumulated: set when storage is allocated (see _allocate)
        super().__init__(layers=[_LayerHandle(self, i) for i in range(self.num_layers)])
        self.n = 0  # slots in use (same for every row, layer and head)
        self.seen = 0  # tokens fed so far
        self.steps = 0  # evictions done
        self.keys = None
        self._pending_valid = None
        self._pad_seen = False  # some fed token was padding (then attention masks are built in full)
        self._block_masks: dict[tuple, torch.Tensor] = {}
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
        self.needs = accumulations(reads)
        cap = max(self.capacity, key_states.shape[-2], 1) if not self.full else max(key_states.shape[-2], 64)
        nl, h, g, d = self.num_layers, self.kv_heads, self.group, self.head_dim
        # one buffer for keys and values, one for the five per-slot statistics: eviction gathers each in one call
        self.kv = torch.zeros(2, nl, b, h, cap, d, device=dev, dtype=dt)
        self.token = torch.full((nl, b, h, cap), -1, device=dev, dtype=torch.long)
        self.st = torch.zeros(len(_STAT_ORDER), nl, b, h, g, cap, device=dev, dtype=torch.float32)
        self.st[_MIN] = float("inf")
        self._bind()
        W = F.QUERY_WINDOW
        self.rq = torch.zeros(nl, b, self.q_heads, W, d, device=dev, dtype=dt)  # the last W queries
        self.rq_token = torch.full((W,), -1, device=dev, dtype=torch.long)
        self.rq_valid = torch.zeros(b, W, device=dev, dtype=torch.bool)
        self.first_real = torch.full((b,), -1, device=dev, dtype=torch.long)
        self._all_started = False
        # decoding queries whose statistics are deferred to the next eviction (see attend / _flush)
        P = max(self.interval or 1, W)
        self.pq = torch.zeros(nl, b, self.q_heads, P, d, device=dev, dtype=dt)
        self.pq_token = torch.full((P,), -1, device=dev, dtype=torch.long)
        self.pq_valid = torch.zeros(b, P, device=dev, dtype=torch.bool)
        self.n_pq = 0

    def _bind(self):
        """Name the views of the shared buffers (``keys``, ``values``, ``st_sum`` ...)."""
        self.keys, self.values = self.kv[0], self.kv[1]
        for i, name in enumerate(_STAT_ORDER):
            setattr(self, "st_" + name, self.st[i])

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
        self.token = ext(self.token, 3, -1)
        st = ext(self.st, 5, 0)
        st[_MIN, ..., cap:] = float("inf")
        self.st = st
        self._bind()
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
        if self.observer is not None:
            self.observer(self, layer_idx, n_old, q)
        _active.state = (self, layer_idx, k_view)
        return k_view, v_view

    @property
    def observer(self):
        """A stateful policy's ``observe(cache, layer, first_new_slot, count)``, called as new pairs arrive."""
        return getattr(self.policy, "observe", None)

    def _begin_chunk(self, key_states, q: int):
        if self._chunk is not None:
            raise RuntimeError("BoundedCache: the previous forward never reached the 'foresight' attention function; "
                               "load the model with attn_implementation='foresight' "
                               "(foresight.attention.use_foresight_attention)")
        if self.keys is None:
            self._allocate(key_states)
        first_block = not self.full and self.steps == 0 and self.seen <= self.target < self.seen + q
        if self.n_pq and (q > 1 or first_block):
            self._flush()  # deferred statistics go in before a chunk's own (query order) or a block reset
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
            if not self._pad_seen and not bool(valid.all()):
                self._pad_seen = True
        self._chunk = (self.n, q, valid)
        if first_block:
            self._reset_block(slice(0, self.n))  # the block before the first eviction starts here
        tok = torch.arange(self.seen, self.seen + q, device=dev)
        if not self._all_started:  # the first real token of each row (sinks are counted from it)
            new_first = (self.first_real < 0) & valid.any(1)
            self.first_real = torch.where(new_first, self.seen + valid.long().argmax(1), self.first_real)
            self._all_started = bool((self.first_real >= 0).all())
        tok_b = torch.where(valid, tok.unsqueeze(0), torch.full_like(tok.unsqueeze(0), -1))
        self.token[:, :, :, self.n:self.n + q] = tok_b[None, :, None, :]
        # slots >= n always hold clean statistics (allocation, _grow and _gather keep them so)

    def _finish_chunk(self):
        n_old, q, valid = self._chunk
        self.n = n_old + q
        self.seen += q
        self.peak_slots = max(self.peak_slots, self.n)
        self._chunk = None

    # -------------------------------------------------------------------------------------------- attention
    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the new queries against this layer's slots; accumulates the block statistics.

        query: [b, Hq, q, d] (after RoPE). Returns [b, q, Hq, d] like transformers' attention functions.

        A chunk (q > 1: prefill, teacher-forced rollout) computes the probabilities explicitly and adds them to
        the statistics at once. A decoding step (q = 1) runs fused SDPA and only stores its query; the queries
        since the last eviction are replayed in one batched pass when the statistics are next needed
        (:meth:`_flush`: before an eviction, a chunk, or a block reset). Between evictions the slots only grow
        and causality is by token index, so the replay sees exactly the keys each query saw: same statistics,
        far fewer small operations per generated token.
        """
        n_old, q, valid = self._chunk
        n = n_old + q
        b, hq, _, d = query.shape
        self.scaling = scaling
        K = self.keys[layer_idx, :, :, :n]
        V = self.values[layer_idx, :, :, :n]
        ktok = self.token[layer_idx, :, :, :n]  # [b, h, n]
        if q == 1 and not self.full:
            vis = ktok >= 0
            vis[:, :, n - 1] = True  # a padding query attends to itself only (its output is never used)
            mask = vis.repeat_interleave(self.group, dim=1)[:, :, None, :]
            out = torch.nn.functional.scaled_dot_product_attention(query, K, V, attn_mask=mask, scale=scaling,
                                                                   enable_gqa=True)
            if self.needs:
                self.pq[layer_idx, :, :, self.n_pq] = query[:, :, 0]
            if layer_idx == self.num_layers - 1:
                if self.needs:
                    self.pq_token[self.n_pq] = self.seen
                    self.pq_valid[:, self.n_pq] = valid[:, 0]
                    self.n_pq += 1
                self._finish_chunk()
                if self.n_pq == self.pq.shape[3]:
                    self._flush()
            return out.transpose(1, 2)
        qtok = torch.arange(self.seen, self.seen + q, device=query.device)
        if self.needs & _PROB_ACCUMULATIONS:
            probs, hidden = self._probs(layer_idx, query, n, qtok, True, scaling)
            # the g query heads of a KV head share its keys: one [g*q, n] x [n, d] product per KV head, no broadcast
            out = torch.matmul(probs.to(V.dtype).view(b, self.kv_heads, -1, n), V)  # [b,h,g*q,d]
            out = out.reshape(b, hq, q, d)
            with torch.no_grad():
                self._accumulate(layer_idx, probs, hidden, valid)
        else:  # no statistic needs the probabilities: fused attention
            out = torch.nn.functional.scaled_dot_product_attention(
                query, K, V, attn_mask=self._chunk_mask(layer_idx, n, q), scale=scaling, enable_gqa=True)
        if "window" in self.needs:
            self._remember_queries(layer_idx, query, qtok, valid)
        if layer_idx == self.num_layers - 1:
            self._finish_chunk()
        return out.transpose(1, 2)

    def _chunk_mask(self, layer_idx: int, n: int, q: int) -> torch.Tensor:
        """The attention mask of a chunk's q queries (the last q slots) over n slots, for fused attention: additive
        [q, n] (cached per size) without padding, else boolean [b, Hq, q, n] by token index (a padding query sees
        its own slot)."""
        if not self._pad_seen:
            m = self._block_masks.get((q, n))
            if m is None:
                if len(self._block_masks) > 16:
                    self._block_masks.clear()
                m = torch.zeros(q, n, device=self.keys.device, dtype=self.keys.dtype)  # the query's dtype (GPU kernels)
                m[:, n - q:] -= causal_block(q, m.device)
                self._block_masks[(q, n)] = m
            return m
        qtok = torch.arange(self.seen, self.seen + q, device=self.token.device)
        return self._visible(layer_idx, n, qtok, own=True).repeat_interleave(self.group, dim=1)

    def _visible(self, layer_idx: int, n: int, qtok, own: bool) -> torch.Tensor:
        """[b, h, q, n]: which of the first n slots each query (tokens ``qtok``, held by the last q slots) may see:
        real keys up to its own token. ``own``: a padding query also sees its own slot (chunks: its output is never
        used, but its softmax must not be empty)."""
        ktok = self.token[layer_idx, :, :, :n]
        vis = (ktok[:, :, None, :] <= qtok[None, None, :, None]) & (ktok >= 0)[:, :, None, :]
        if own:
            q = qtok.shape[0]
            vis = vis | (torch.arange(n, device=ktok.device)[None, :] == (n - q + torch.arange(q, device=ktok.device))[:, None])
        return vis

    def _probs(self, layer_idx: int, query, n: int, qtok, own: bool, scaling: float):
        """Post-softmax attention [b, h, g, q, n] of ``query`` [b, Hq, q, d] (tokens ``qtok``) to the first n slots,
        causal by token index. The q queries are the tokens of the last q slots (a chunk, or the replayed decoding
        queries), so every older slot is visible to all of them and only the newest [q, q] block is causal.
        ``own``: a padding query sees its own slot (chunks; its output is never used).

        Returns the probabilities and the mask of keys a query could not see: ``None`` when no padding was ever fed
        (then the hidden keys are exactly the upper triangle of the newest block, see :func:`causal_block`)."""
        b, hq, q, d = query.shape
        h, g = self.kv_heads, self.group
        K = self.keys[layer_idx, :, :, :n]
        # the scale goes on the [q, d] queries, not on the [q, n] scores: one small multiply instead of a large one
        scores = torch.matmul((query * scaling).reshape(b, h, g * q, d), K.transpose(-1, -2)).float().view(b, h, g, q, n)
        if not self._pad_seen:
            scores[..., n - q:].sub_(causal_block(q, query.device))  # additive mask: cheaper than masked_fill
            return torch.softmax(scores, -1), None
        hidden = ~self._visible(layer_idx, n, qtok, own)[:, :, None]  # [b, h, 1, q, n]: the same for the group
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), -1)
        return probs if own else probs.nan_to_num_(0.0), hidden

    @torch.no_grad()
    def _accumulate(self, layer_idx: int, probs, hidden, valid):
        """Add a group of queries' attention to the block statistics (those in ``self.needs``).
        ``hidden``: the [.., q, n] mask of keys a query could not see; ``valid`` [b, q]: real (not padding) queries."""
        n, q = probs.shape[-1], probs.shape[-2]
        st_min, st_max = self.st_min[layer_idx], self.st_max[layer_idx]
        need = self.needs
        if hidden is None:  # no padding: all queries real, only the newest [q, q] block is causal
            w, old = probs, n - q
            if "min" in need:
                torch.minimum(st_min[..., :old], probs[..., :old].amin(3), out=st_min[..., :old])
                lo = (probs[..., old:] + causal_block(q, probs.device)).amin(3)  # +inf on keys not yet seen
                torch.minimum(st_min[..., old:n], lo, out=st_min[..., old:n])
        else:
            qv = valid[:, None, None, :, None]
            w = probs * qv
            if "min" in need:
                wmin = probs.masked_fill(hidden | ~qv, float("inf")).amin(3)
                torch.minimum(st_min[..., :n], wmin, out=st_min[..., :n])
        if "max" in need:
            torch.maximum(st_max[..., :n], w.amax(3), out=st_max[..., :n])
        if "sum" in need:
            wsum = w.sum(3)
            self.st_sum[layer_idx, ..., :n] += wsum
            self.st_cum[layer_idx, ..., :n] += wsum

    def _remember_queries(self, layer_idx: int, query, qtok, valid):
        """Keep the latest W queries (the window statistics are recomputed from them at eviction time)."""
        q = query.shape[2]
        W = F.QUERY_WINDOW
        if q >= W:
            self.rq[layer_idx].copy_(query[:, :, q - W:])
        else:
            self.rq[layer_idx] = torch.cat([self.rq[layer_idx], query], dim=2)[:, :, -W:]
        if layer_idx == self.num_layers - 1:
            if q >= W:
                self.rq_token, self.rq_valid = qtok[q - W:], valid[:, q - W:]
            else:
                self.rq_token = torch.cat([self.rq_token, qtok])[-W:]
                self.rq_valid = torch.cat([self.rq_valid, valid], 1)[:, -W:]

    @torch.no_grad()
    def _flush(self):
        """Replay the deferred decoding queries: their statistics, as if computed when they ran."""
        P, n = self.n_pq, self.n
        if P == 0:
            return
        scale = self.scaling
        qtok, valid = self.pq_token[:P].clone(), self.pq_valid[:, :P].clone()
        for layer in range(self.num_layers):
            query = self.pq[layer, :, :, :P]
            if self.needs & _PROB_ACCUMULATIONS:
                probs, hidden = self._probs(layer, query, n, qtok, False, scale)
                self._accumulate(layer, probs, hidden, valid)
            if "window" in self.needs:
                self._remember_queries(layer, query, qtok, valid)
        self.n_pq = 0

    # ---------------------------------------------------------------------------------------------- evict
    def _window_stats(self, n: int, at: tuple | None = None) -> dict:
        """Sums over the last 1/8/16/32 queries, recomputed from the kept queries (see features.py). ``at``: the
        (evictions, tokens seen) of the view asking; a view older than the cache's state cannot have them."""
        if at is not None:
            self._check_current(at)
        nl, h, g = self.num_layers, self.kv_heads, self.group
        b = self.keys.shape[1]
        W = F.QUERY_WINDOW
        K = self.keys[:, :, :, :n]  # [nl,b,h,n,d]
        rq = (self.rq * self.scaling).view(nl, b, h, g * W, -1)
        scores = torch.matmul(rq, K.transpose(-1, -2)).float().view(nl, b, h, g, W, n)
        ktok = self.token[:, :, :, :n]
        newest = ktok[..., max(n - W, 0):]
        if not self._pad_seen and n >= W and torch.equal(newest, self.rq_token.expand_as(newest)):
            # the W queries are the tokens of the newest W slots (no padding): only that [W, W] block is causal,
            # and query i sees the n - W + i + 1 keys up to itself
            scores[..., n - W:].sub_(causal_block(W, scores.device))
            probs = scores.softmax(-1)
            visible = torch.arange(n - W + 1, n + 1, device=scores.device, dtype=torch.float32)[:, None]
            hits = probs >= 1.0 / visible  # a hidden key has probability 0: never a hit
        else:
            vis = (ktok[:, :, :, None, None, :] <= self.rq_token[None, None, None, None, :, None]) & \
                  (ktok >= 0)[:, :, :, None, None, :]
            vis = vis & (self.rq_token >= 0)[None, None, None, None, :, None]
            probs = scores.masked_fill(~vis, float("-inf")).softmax(-1).nan_to_num(0.0)
            probs = probs * self.rq_valid[None, :, None, None, :, None]
            visible = vis.sum(-1, keepdim=True).clamp(min=1)
            hits = (probs >= 1.0 / visible) & vis
        out = {"pivot32": hits.sum(-2, dtype=torch.float32)}  # Scissorhands' counts
        for w in F.WINDOWS:
            out[f"w{w}"] = probs[..., -w:, :].sum(-2)
        return out

    def _min_stat(self, n: int, at: tuple) -> torch.Tensor:
        self._check_current(at)
        return torch.nan_to_num(self.st_min[..., :n], posinf=0.0)  # 0 for a key no block query saw

    def _check_current(self, at: tuple):
        if at != (self.steps, self.seen):
            raise RuntimeError("this EvictionView is stale: the cache changed since it was made, so its lazily "
                               "computed statistics cannot be computed any more (use view.snapshot() to keep one)")

    def _reset_block(self, sl):
        self.st[:_CUM, ..., sl] = 0  # sum and max; cum and decay carry over
        self.st[_MIN, ..., sl] = float("inf")

    def view(self) -> EvictionView:
        self._flush()
        n = self.n
        need, at = self.needs, (self.steps, self.seen)
        stats = {}
        if "max" in need:
            stats["max"] = self.st_max[..., :n]
        if "sum" in need:
            stats.update(sum=self.st_sum[..., :n], cum=self.st_cum[..., :n], decay=self.st_decay[..., :n])
        lazy = []
        if "window" in need:
            lazy.append((_WINDOW_KEYS, lambda: self._window_stats(n, at)))
        if "min" in need:
            lazy.append(({"min"}, lambda: {"min": self._min_stat(n, at)}))
        missing = "" if need == _ALL_ACCUMULATIONS else (
            f"policy {getattr(self.policy, 'name', self.policy)!r} declares reads="
            f"{sorted(self.policy.reads)} (Policy.reads), and the cache computes only those")
        stats = _Stats(stats, lazy, missing)
        tok = self.token[:, :, :, :n]
        evictable = tok >= 0
        slot = torch.arange(n, device=tok.device)
        evictable &= (slot < n - min(self.window, n))  # the newest `window` (default L) are protected
        if self.sinks:
            first = self.first_real[None, :, None, None]
            evictable &= ~((tok >= 0) & (first >= 0) & (tok < first + self.sinks))
        if self.protected_prefix:
            evictable &= slot >= self.protected_prefix
        return EvictionView(self.keys[:, :, :, :n], self.values[:, :, :, :n], tok, stats, evictable,
                            n_evict=0, step=self.steps, seen=self.seen, prompt_len=self.prompt_len or 0,
                            generator=self.generator, slot={k: v[..., :n] for k, v in self.slot_data.items()})

    @torch.no_grad()
    def evict(self, n_evict: int):
        """Drop ``n_evict`` pairs per (layer, sequence, KV head); padding first, then by the policy's scores."""
        self._flush()
        n = self.n
        if "sum" in self.needs:
            self.st_decay[..., :n].mul_(F.DECAY).add_(self.st_sum[..., :n])
        view = self.view()
        view.n_evict = n_evict
        tok = view.token
        scores = self.policy.score(view).float()
        evictable = view.evictable
        if self._pad_seen:  # padding slots go first (without padding, every slot below n holds a real token)
            pad = (tok < 0) & (torch.arange(n, device=tok.device) >= self.protected_prefix)
            scores = torch.where(pad, torch.full_like(scores, 1e30), scores)
            evictable = evictable | pad
        n_cand = int(evictable.sum(-1).min())
        if n_cand < n_evict:
            raise RuntimeError(f"only {n_cand} evictable pairs for {n_evict} evictions: B, L, sinks and the "
                               "protected prompt leave too little room")
        if self.selection == "sample":
            chosen = selection.sample_top2l(scores, evictable, n_evict, self.temperature, self.generator)
        else:
            chosen = selection.select_topk(scores, evictable, n_evict)
        drop = torch.zeros_like(evictable).scatter_(-1, chosen, True)
        order = (~drop).nonzero()[:, -1].view(*drop.shape[:-1], n - n_evict)  # kept slots, ascending per row
        if self.recorder is not None:
            self.recorder({"step": self.steps, "seen": self.seen, "token": tok.clone(), "chosen": chosen,
                           "scores": scores, "evictable": evictable, "view": view.snapshot()})
        self._gather(order)
        self.n = n - n_evict
        self._reset_block(slice(0, self.n))
        self.steps += 1

    def _gather(self, order):
        """Keep the slots ``order`` ([nl,b,h,k], ascending) in every per-slot tensor."""
        k, n = order.shape[-1], self.n
        nl, b, h = order.shape[:3]
        idx_kv = order[None, ..., None].expand(2, nl, b, h, k, self.head_dim)
        self.kv[..., :k, :] = self.kv[..., :n, :].gather(4, idx_kv)
        self.token[..., :k] = self.token[..., :n].gather(3, order)
        idx_st = order[None, :, :, :, None].expand(len(_STAT_ORDER), nl, b, h, self.group, k)
        self.st[..., :k] = self.st[..., :n].gather(5, idx_st)
        for t in self.slot_data.values():
            t[..., :k] = t[..., :n].gather(3, order)
        self.token[..., k:] = -1
        self.st[:_MIN, ..., k:n] = 0
        self.st[_MIN, ..., k:n] = float("inf")

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
        if self.keys is None:
            return 0
        return self.kv.numel() * self.kv.element_size()

    def held(self) -> int:
        """Pairs held per (sequence, layer, KV head) right now."""
        return self.n
