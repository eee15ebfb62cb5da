"""The statistics a bounded cache accumulates (foresight.engine.cache.attention_stats): equal to dense attention, deferred
decoding statistics equal to chunked ones, fast paths equal to the fully masked ones, only what a policy declares."""

import pytest
import torch

from conftest import feed_chunks, tiny_qwen3
from foresight.engine.cache.bounded import BoundedCache
from foresight.config.eviction import EvictionSettings
from foresight.engine.features import STAT_NAMES
from foresight.policies import make_policy
from foresight.policies.base import Policy
from foresight.engine.rollout import rollout


class _ReadsAll(Policy):
    """Scores like ``inner`` but declares nothing, so the cache computes every statistic."""

    def __init__(self, inner):
        self.inner = inner

    def score(self, view):
        return self.inner.score(view)


def _first_eviction_view(m, ids, B, L):
    """The (recorded) view of the first eviction after feeding ``ids`` [1, B + L] and one more token."""
    views = []
    c = BoundedCache(m.config, make_policy("h2o"), EvictionSettings(budget=B, interval=L),
                     recorder=lambda s: views.append(s["view"]))
    with torch.no_grad():
        feed_chunks(m, c, ids)
        m(input_ids=torch.randint(8, 170, (1, 1)), cache=c, use_cache=True)  # triggers the eviction
    return views[0]


def test_statistics_match_dense_attention():
    """At the first eviction every statistic equals the one computed from the dense attention matrix."""
    m = tiny_qwen3()
    eager = tiny_qwen3()
    eager.set_attn_implementation("eager")
    B, L = 40, 32
    ids = torch.randint(8, 170, (1, B + L))
    v = _first_eviction_view(m, ids, B, L)
    with torch.no_grad():
        att = eager(ids, output_attentions=True).attentions  # per layer [1, Hq, S, S]
    assert v.keys.shape[3] == B + L
    for layer, A in enumerate(att):
        A = A[0].view(2, 2, B + L, B + L)  # [kv, g, q, k]
        blk = A[:, :, B:]
        seen = torch.ones_like(blk, dtype=torch.bool)
        seen &= torch.arange(B + L)[None, None, None, :] <= torch.arange(B, B + L)[None, None, :, None]
        ref = {"sum": blk.sum(2), "max": blk.amax(2), "min": blk.masked_fill(~seen, float("inf")).amin(2),
               "w8": blk[:, :, -8:].sum(2), "w16": blk[:, :, -16:].sum(2), "w32": blk[:, :, -32:].sum(2),
               "cum": A.sum(2), "decay": blk.sum(2), "w1": blk[:, :, -1]}
        for name in list(STAT_NAMES) + ["w1"]:
            got = v.stats[name][layer, 0]
            assert torch.allclose(got, ref[name], atol=1e-5), (layer, name)


def test_ahead_statistics_are_the_recent_queries_attention_at_later_positions():
    """``a{Δ}`` at the first eviction equals the dense attention of the last 32 queries recomputed by the model's own
    projections and rotary embedding at their positions + Δ (each over the keys up to its own token)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from foresight.engine.features import AHEAD_NAMES, AHEAD_SHIFTS

    m = tiny_qwen3()
    B, L = 40, 32
    S = B + L
    ids = torch.randint(8, 170, (1, S))
    v = _first_eviction_view(m, ids, B, L)
    with torch.no_grad():
        hidden = m(ids, output_hidden_states=True).hidden_states
        hq, hk, d = 4, 2, m.config.head_dim
        pos = torch.arange(S)[None]
        for layer, block in enumerate(m.model.layers):
            a = block.self_attn
            x = block.input_layernorm(hidden[layer])
            q = a.q_norm(a.q_proj(x).view(1, S, hq, d)).transpose(1, 2)
            k = a.k_norm(a.k_proj(x).view(1, S, hk, d)).transpose(1, 2)
            cos, sin = m.model.rotary_emb(x, pos)
            _, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = k[0].repeat_interleave(hq // hk, 0)  # [hq, S, d]
            for name, shift in zip(AHEAD_NAMES, AHEAD_SHIFTS):
                cos, sin = m.model.rotary_emb(x, pos + shift)
                qs, _ = apply_rotary_pos_emb(q, q, cos, sin)
                logits = (qs[0, :, S - 32:] @ k.transpose(1, 2)) * a.scaling  # [hq, 32, S]
                hidden_keys = torch.arange(S)[None, :] > torch.arange(S - 32, S)[:, None]
                ref = logits.masked_fill(hidden_keys, float("-inf")).softmax(-1).sum(1).view(hk, hq // hk, S)
                assert torch.allclose(v.stats[name][layer, 0], ref, atol=1e-5), (layer, name)
    assert not torch.allclose(v.stats["a128"], v.stats["w32"], atol=1e-3)  # the shift changes what they attend to


def test_deferred_decoding_statistics_equal_chunked_ones():
    """Token-by-token decoding defers its statistics to the eviction; they equal the chunked rollout's."""
    m = tiny_qwen3()
    ids = torch.randint(8, 170, (2, 90))
    got = {}
    for mode in ("chunks", "tokens"):
        views = []
        c = BoundedCache(m.config, make_policy("h2o"), EvictionSettings(budget=24, interval=8),
                         recorder=lambda s: views.append(s["view"]))
        with torch.no_grad():
            if mode == "chunks":
                feed_chunks(m, c, ids)
            else:
                for t in range(ids.shape[1]):
                    m(input_ids=ids[:, t:t + 1], cache=c, use_cache=True)
        got[mode] = views
    assert len(got["chunks"]) == len(got["tokens"]) > 5
    for a, b in zip(got["chunks"], got["tokens"]):
        assert torch.equal(a.token, b.token)
        for name in a.stats:
            assert torch.allclose(a.stats[name], b.stats[name], atol=1e-5), name


@pytest.mark.parametrize("B,L", [(24, 8), (64, 32)])
def test_fast_causal_path_equals_fully_masked_path(B, L, monkeypatch):
    """Without padding only the newest block is masked; the statistics equal those of the fully masked path that
    padded batches take (chunks and replayed decoding queries alike). With L >= 32 the window sums take their own
    fast path too (the 32 kept queries are then the newest 32 slots, which the protected window never evicts: no
    device-side check, no host sync); with L < 32 that is checked at each eviction."""
    from foresight.engine.cache import kept_queries

    checks = []
    check = kept_queries.newest_are_recent
    monkeypatch.setattr(kept_queries, "newest_are_recent", lambda st, t: checks.append(1) or check(st, t))
    m = tiny_qwen3()
    S, cut = max(100, 4 * B), max(60, 2 * B + 12)  # chunks up to `cut`, then token-by-token decoding
    ids = torch.randint(8, 170, (2, S))
    got = {}
    for full_mask in (False, True):
        views = []
        c = BoundedCache(m.config, make_policy("h2o"), EvictionSettings(budget=B, interval=L),
                         recorder=lambda s: views.append(s["view"]))
        c.padded = full_mask
        with torch.no_grad():
            feed_chunks(m, c, ids[:, :cut])
            for t in range(cut, S):
                m(input_ids=ids[:, t:t + 1], cache=c, use_cache=True)
        got[full_mask] = views
        if not full_mask:
            assert (len(checks) > 0) == (L < 32)
    assert len(got[False]) == len(got[True]) > 3
    for a, b in zip(got[False], got[True]):
        assert torch.equal(a.token, b.token)
        assert set(a.stats) == set(b.stats) >= set(STAT_NAMES)
        for name in a.stats:
            assert torch.allclose(a.stats[name], b.stats[name], atol=1e-6), name


def test_window_statistics_are_lazy_and_a_stale_view_refuses_them(qwen3):
    c = BoundedCache(qwen3.config, _ReadsAll(make_policy("h2o")), EvictionSettings(budget=24, interval=8))
    with torch.no_grad():
        feed_chunks(qwen3, c, torch.randint(8, 170, (1, 30)))
    v = c.view()
    assert "w8" not in v.stats and "sum" in v.stats  # an eviction reading only `cum` never computed the window sums
    early = c.view()
    assert v.stats["w8"].shape == v.stats["sum"].shape and "w32" in v.stats
    with torch.no_grad():
        feed_chunks(qwen3, c, torch.randint(8, 170, (1, 10)))  # an eviction happens
    with pytest.raises(RuntimeError, match="stale"):
        early.stats["w8"]


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "tova", "snapkv", "scissorhands"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_policy_gets_what_it_declares_and_skipping_the_rest_changes_nothing(name, padded):
    """The cache accumulates only the statistics a policy declares (StreamingLLM: none, so fused attention); the
    evictions and per-token losses equal those of a run that computes everything."""
    m = tiny_qwen3()
    ids = torch.randint(8, 170, (2, 150))
    mask = torch.ones_like(ids, dtype=torch.bool)
    if padded:
        mask[0, :7] = False
    sinks = 4 if name == "streamingllm" else 0
    kept, losses, caches = [], [], []
    for pol in (make_policy(name), _ReadsAll(make_policy(name))):
        losses.append(rollout(m, ids, pol, EvictionSettings(budget=48, interval=16, sinks=sinks), attention_mask=mask).token_loss)
    for pol in (make_policy(name), _ReadsAll(make_policy(name))):
        c = BoundedCache(m.config, pol, EvictionSettings(budget=48, interval=16, sinks=sinks))
        with torch.no_grad():
            s = 0
            while s < ids.shape[1]:
                q = c.next_chunk(ids.shape[1] - s)
                m(input_ids=ids[:, s:s + q], cache=c, use_cache=True, **c.feed(mask[:, s:s + q]))
                s += q
            for t in range(20):  # decoding steps: deferred statistics only where declared
                m(input_ids=ids[:, t:t + 1], cache=c, use_cache=True, **c.feed(torch.ones(2, 1, dtype=torch.bool)))
        kept.append(c.token[..., :c.n].clone())
        caches.append(c)
    assert torch.equal(kept[0], kept[1])
    assert torch.allclose(losses[0], losses[1], atol=1e-5)
    declared, everything = caches[0].view().stats, caches[1].view().stats
    assert set(everything) >= {"max", "sum", "cum", "decay"}
    if name == "streamingllm":
        assert caches[0].needs == frozenset() and caches[0].stats.n_pending == 0  # no decoding query kept for statistics
    if name == "h2o":
        assert torch.allclose(declared["cum"], everything["cum"], atol=1e-6)
    if name != "h2o":
        with pytest.raises(KeyError, match=f"'{name}'.*reads"):
            declared["cum"]
    with pytest.raises(KeyError, match="was not computed"):
        declared["max"]


def test_a_policy_declaring_an_unknown_statistic_is_refused(qwen3):
    class Odd(Policy):
        name, reads = "odd", frozenset({"cum", "w64"})

    with pytest.raises(ValueError, match="w64"):
        BoundedCache(qwen3.config, Odd(), EvictionSettings(budget=24, interval=8))


@pytest.mark.parametrize("cap", [0, 1 << 19])
def test_the_replay_of_deferred_queries_over_layer_slices_equals_layer_by_layer_accumulation(cap, monkeypatch):
    """Without padding the deferred decoding queries are replayed a slice of layers per pass (one layer per pass with
    the one-pass limit at 0, all at once under the default): the statistics buffer is bit for bit what accumulating
    each layer's probabilities gives."""
    from foresight.engine import features
    from foresight.engine.attention_shape import AttentionShape
    from foresight.engine.cache.attention_stats import ALL_ACCUMULATIONS, SlotStatistics, StatsLayout
    from foresight.engine.cache.slot_attention import probabilities

    monkeypatch.setattr(features, "ALL_LAYERS_MAX_VALUES", cap)
    g = torch.Generator().manual_seed(4)
    shape, n, P = AttentionShape(5, 6, 2, 8), 47, 9
    st = SlotStatistics(ALL_ACCUMULATIONS, StatsLayout(shape, 2, 64, 16), "cpu", torch.float32)
    st.buf.uniform_(0, 1, generator=g)  # statistics already accumulated by earlier chunks
    st.pending_q[:, :, :, :P] = torch.randn(5, 2, 6, P, 8, generator=g)
    st.pending_token[:P] = torch.arange(n - P, n)
    st.pending_valid[:, :P] = True
    st.n_pending = P
    keys = torch.randn(5, 2, 2, 64, 8, generator=g)
    want = st.buf.clone()
    ref = SlotStatistics(ALL_ACCUMULATIONS, StatsLayout(shape, 2, 64, 16), "cpu", torch.float32)
    ref.buf.copy_(want)
    for layer in range(5):
        probs, hidden = probabilities(st.pending_q[layer, :, :, :P], keys[layer, :, :, :n], None, None, False, False,
                                      0.3)
        ref.accumulate(layer, probs, hidden, st.pending_valid[:, :P])
    st.replay(keys, torch.zeros(5, 2, 2, 64, dtype=torch.long), n, False, 0.3)
    assert st.n_pending == 0 and not torch.equal(st.buf, want)
    assert torch.equal(st.buf, ref.buf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_window_sums_summed_by_the_replay_equal_recomputed_ones(dtype):
    """When the W deferred queries are the kept ones, the replay sums the window statistics from its probabilities;
    an eviction view reads them instead of recomputing them, bit for bit the same; a new query discards them."""
    from foresight.engine.attention_shape import AttentionShape
    from foresight.engine.cache import kept_queries
    from foresight.engine.cache.attention_stats import ALL_ACCUMULATIONS, SlotStatistics, StatsLayout

    g = torch.Generator().manual_seed(5)
    W, n = 32, 75
    st = SlotStatistics(ALL_ACCUMULATIONS, StatsLayout(AttentionShape(4, 6, 2, 8), 1, 96, W), "cpu", dtype,
                        newest_kept=True)
    st.pending_q.copy_(torch.randn(st.pending_q.shape, generator=g))
    st.pending_token[:] = torch.arange(n - W, n)
    st.pending_valid[:] = True
    st.n_pending = W
    keys = torch.randn(4, 1, 2, 96, 8, generator=g).to(dtype)
    token = torch.arange(96).expand(4, 1, 2, 96)
    st.replay(keys, token, n, False, 0.3)
    assert st.window_ready is not None and st.window_ready[0] == n
    fast = kept_queries.window_stats(st, keys, token, n, False, 0.3, 1)
    st.window_ready = None
    slow = kept_queries.window_stats(st, keys, token, n, False, 0.3, 1)
    assert set(fast) == set(slow) == {"pivot32", *(f"w{w}" for w in (1, 8, 16, 32))}
    assert all(torch.equal(fast[k], slow[k]) for k in slow)
    st.window_ready = (n, fast)
    st.remember_queries(0, st.pending_q[0, :, :, :1], torch.tensor([n]), torch.ones(1, 1, dtype=torch.bool))
    assert st.window_ready is None
