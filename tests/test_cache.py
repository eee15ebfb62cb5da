import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_llama, tiny_qwen3
from foresight.cache import BoundedCache
from foresight.config import EvictionSettings
from foresight.features import STAT_NAMES
from foresight.generate import generate
from foresight.policies import make_policy
from foresight.policies.base import Policy
from foresight.rollout import loss_and_entropy, rollout


def feed_chunks(model, cache, ids):
    outs, s = [], 0
    while s < ids.shape[1]:
        q = cache.next_chunk(ids.shape[1] - s)
        outs.append(model(input_ids=ids[:, s:s + q], cache=cache, use_cache=True).logits)
        s += q
    return torch.cat(outs, 1)


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama])
def test_no_eviction_equals_plain_model(make):
    m = make()
    ids = torch.randint(8, 170, (2, 60))
    with torch.no_grad():
        ref = m(ids).logits
        got = feed_chunks(m, BoundedCache(m.config, make_policy("h2o"), EvictionSettings(budget=64, interval=16)), ids)
    assert torch.allclose(ref, got, atol=1e-5)
    # the drivers' forwards (a placeholder 4-D mask instead of transformers' causal mask), explicit and fused attention
    nll, _ = loss_and_entropy(ref[:, :-1], ids[:, 1:])
    for name in ("h2o", "streamingllm"):
        r = rollout(m, ids, make_policy(name), EvictionSettings(budget=64, interval=16))
        assert torch.allclose(r.token_loss[:, 1:], nll, atol=1e-4), name


def test_rollout_equals_token_by_token_generation_under_eviction(qwen3):
    ids = torch.randint(8, 170, (2, 20))
    for name in ("h2o", "tova", "snapkv", "rkv", "scissorhands", "streamingllm", "keydiff"):
        g = generate(qwen3, ids, max_new_tokens=50, policy=make_policy(name), settings=EvictionSettings(budget=16, interval=4))
        r = rollout(qwen3, g.sequences, make_policy(name), EvictionSettings(budget=16, interval=4))
        assert g.cache.steps > 5
        assert torch.allclose(r.token_loss[:, 20:], -g.logprobs, atol=1e-4), name


def test_generation_matches_transformers_generate_with_full_budget(qwen3):
    ids = torch.randint(8, 170, (2, 12))
    ref = qwen3.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    full = generate(qwen3, ids, max_new_tokens=30)
    big = generate(qwen3, ids, max_new_tokens=30, policy=make_policy("h2o"), settings=EvictionSettings(budget=128, interval=32))
    assert torch.equal(ref, full.sequences) and torch.equal(ref, big.sequences)
    assert big.cache.steps == 0


def test_left_padded_batch_equals_single_sequences_without_eviction(qwen3):
    a = torch.randint(8, 170, (1, 10))
    b = torch.randint(8, 170, (1, 14))
    ids = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    out = generate(qwen3, ids, mask, max_new_tokens=15, policy=make_policy("h2o"),
                   settings=EvictionSettings(budget=64, interval=16))
    for row, single in ((0, a), (1, b)):
        ref = generate(qwen3, single, max_new_tokens=15)
        assert torch.equal(out.new_tokens[row], ref.new_tokens[0])
        assert torch.allclose(out.logprobs[row], ref.logprobs[0], atol=1e-4)


def test_cache_is_really_bounded_and_keeps_newest(qwen3):
    B, L = 24, 8
    seen_sizes = []

    def rec(step):
        seen_sizes.append(step["token"].shape[-1])

    ids = torch.randint(8, 170, (3, 150))
    c = BoundedCache(qwen3.config, make_policy("random"), EvictionSettings(budget=B, interval=L), recorder=rec,
                     generator=torch.Generator().manual_seed(0))
    feed_chunks(qwen3, c, ids)
    assert c.keys.shape[3] == B + L  # storage allocated once at B+L slots, never grown
    assert set(seen_sizes) == {B + L} and c.steps == (150 - B - L) // L + 1
    tok = c.token[:, :, :, : c.n]
    assert (tok >= 0).all()
    # every head holds distinct tokens, sorted by time, and the newest tokens since the last eviction are there
    assert (tok.diff(dim=-1) > 0).all()
    newest = torch.arange(150 - (c.n - B) - L, 150)
    assert torch.isin(newest, tok[0, 0, 0]).all()
    # different heads keep different sets (per-head eviction)
    assert not torch.equal(tok[0, 0, 0], tok[0, 0, 1])


def test_sinks_protected(qwen3):
    ids = torch.randint(8, 170, (1, 100))
    c = BoundedCache(qwen3.config, make_policy("streamingllm"), EvictionSettings(budget=20, interval=4, sinks=4))
    feed_chunks(qwen3, c, ids)
    tok = c.token[0, 0, 0, : c.n].tolist()
    assert tok[:4] == [0, 1, 2, 3] and tok[4:] == list(range(100 - c.n + 4, 100))


def test_impossible_settings_fail_at_construction(qwen3):
    with pytest.raises(ValueError, match="must be smaller than the budget"):
        BoundedCache(qwen3.config, make_policy("h2o"), EvictionSettings(budget=16, interval=16))
    with pytest.raises(ValueError, match="budget must be > 0"):
        EvictionSettings(budget=0, interval=4).validate()
    with pytest.raises(ValueError, match="sinks \\+ interval"):
        BoundedCache(qwen3.config, make_policy("h2o"), EvictionSettings(budget=16, interval=8, sinks=10))
    with pytest.raises(ValueError, match="interval must be > 0"):
        EvictionSettings(budget=16, interval=0).validate()


def test_short_sequences_and_long_prompts(qwen3):
    short = torch.randint(8, 170, (1, 5))
    r = rollout(qwen3, short, make_policy("h2o"), EvictionSettings(budget=64, interval=16))
    assert r.token_loss.shape == (1, 5) and r.peak_slots == 5
    long_prompt = torch.randint(8, 170, (2, 90))  # > 2B
    g = generate(qwen3, long_prompt, max_new_tokens=10, policy=make_policy("h2o"),
                 settings=EvictionSettings(budget=32, interval=8))
    assert g.peak_slots <= 32 + 8 and g.new_tokens.shape == (2, 10)


def test_statistics_match_dense_attention():
    """At the first eviction every statistic equals the one computed from the dense attention matrix."""
    m = tiny_qwen3()
    eager = tiny_qwen3()
    eager.set_attn_implementation("eager")
    B, L = 40, 32
    ids = torch.randint(8, 170, (1, B + L))
    views = []
    c = BoundedCache(m.config, make_policy("h2o"), EvictionSettings(budget=B, interval=L),
                     recorder=lambda s: views.append(s["view"]))
    with torch.no_grad():
        feed_chunks(m, c, ids)
        m(input_ids=torch.randint(8, 170, (1, 1)), cache=c, use_cache=True)  # triggers the eviction
        att = eager(ids, output_attentions=True).attentions  # per layer [1, Hq, S, S]
    v = views[0]
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


def test_cache_works_inside_transformers_generate(qwen3):
    ids = torch.randint(8, 170, (1, 10))
    c = BoundedCache(qwen3.config, make_policy("h2o"), EvictionSettings(budget=16, interval=4))
    out = qwen3.generate(ids, cache=c, max_new_tokens=40, do_sample=False)
    assert out.shape[1] == 50 and c.steps >= 8 and c.n <= 20
    mine = generate(qwen3, ids, max_new_tokens=40, policy=make_policy("h2o"), settings=EvictionSettings(budget=16, interval=4))
    assert torch.equal(out, mine.sequences)


def test_wrong_attention_implementation_is_caught():
    m = tiny_qwen3()
    m.set_attn_implementation("sdpa")
    c = BoundedCache(m.config, make_policy("h2o"), EvictionSettings(budget=16, interval=4))
    m(input_ids=torch.randint(8, 170, (1, 4)), cache=c, use_cache=True)
    with pytest.raises(RuntimeError, match="attn_implementation='foresight'"):
        m(input_ids=torch.randint(8, 170, (1, 4)), cache=c, use_cache=True)
    with pytest.raises(ValueError, match="'sdpa', not 'foresight'"):  # the drivers say so before any forward
        rollout(m, torch.randint(8, 170, (1, 40)), make_policy("h2o"), EvictionSettings(budget=16, interval=4))


def test_dynamic_cache_path_unchanged(qwen3):
    ids = torch.randint(8, 170, (1, 30))
    with torch.no_grad():
        a = qwen3(ids).logits
        c = DynamicCache()
        b1 = qwen3(ids[:, :20], cache=c, use_cache=True).logits
        b2 = qwen3(ids[:, 20:], cache=c, use_cache=True).logits
    assert torch.allclose(a, torch.cat([b1, b2], 1), atol=1e-5)


def test_protect_prompt_keeps_every_prompt_token_and_bounds_the_rest(qwen3):
    P = 12
    ids = torch.randint(8, 170, (2, P))
    g = generate(qwen3, ids, max_new_tokens=60, policy=make_policy("random"), generator=torch.Generator().manual_seed(0),
                 settings=EvictionSettings(budget=16, interval=4, protect_prompt=True))
    c = g.cache
    tok = c.token[:, :, :, : c.n]
    assert c.steps > 5
    assert (tok[..., :P] == torch.arange(P)).all()  # the prompt is intact in every head
    assert c.n - P <= 16 + 4  # the budget applies to the generated part


def test_protect_prompt_longer_than_budget(qwen3):
    ids = torch.randint(8, 170, (1, 30))
    with pytest.raises(ValueError, match="prompt has 30 tokens, more than the budget B=16"):
        generate(qwen3, ids, max_new_tokens=5, policy=make_policy("random"),
                 settings=EvictionSettings(budget=16, interval=4, protect_prompt=True))
    g = generate(qwen3, ids, max_new_tokens=5, policy=make_policy("random"),
                 settings=EvictionSettings(budget=16, interval=4, protect_prompt=True, prompt_overflow="evict"))
    assert g.peak_slots <= 20


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


def test_protected_window_option_keeps_a_wider_recent_window(qwen3):
    """The KVpop layout for any policy: sinks + a window of w recent tokens (w > L) + the policy's top set."""
    ids = torch.randint(8, 170, (2, 12))
    g = generate(qwen3, ids, max_new_tokens=60, policy=make_policy("h2o"),
                 settings=EvictionSettings(budget=24, interval=4, sinks=2, window=12))
    c = g.cache
    assert c.window == 12 and c.steps > 5
    tok = c.token[:, :, :, : c.n]
    for t in list(range(2)) + list(range(c.seen - 12, c.seen)):
        assert (tok == t).any(-1).all(), t
    with pytest.raises(ValueError, match="sinks \\+ window"):
        generate(qwen3, ids, max_new_tokens=5, policy=make_policy("h2o"),
                 settings=EvictionSettings(budget=24, interval=4, sinks=2, window=23))


@pytest.mark.parametrize("B,L", [(24, 8), (64, 32)])
def test_fast_causal_path_equals_fully_masked_path(B, L):
    """Without padding only the newest block is masked; the statistics equal those of the fully masked path that
    padded batches take (chunks and replayed decoding queries alike). With L >= 32 the window sums take their own
    fast path too (the 32 kept queries are then the newest 32 slots)."""
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
    assert len(got[False]) == len(got[True]) > 3
    for a, b in zip(got[False], got[True]):
        assert torch.equal(a.token, b.token)
        assert set(a.stats) == set(b.stats) >= set(STAT_NAMES)
        for name in a.stats:
            assert torch.allclose(a.stats[name], b.stats[name], atol=1e-6), name


class _ReadsAll(Policy):
    """Scores like ``inner`` but declares nothing, so the cache computes every statistic."""

    def __init__(self, inner):
        self.inner = inner

    def score(self, view):
        return self.inner.score(view)


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
