import pytest
import torch
from transformers import DynamicCache

from conftest import feed_chunks, tiny_llama, tiny_qwen3
from foresight.engine.cache.bounded import BoundedCache
from foresight.config.eviction import EvictionSettings
from foresight.engine.generate import GenerateOptions, generate
from foresight.policies import make_policy
from foresight.engine.rollout import RolloutOptions, loss_and_entropy, rollout


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
    for name in ("h2o", "tova", "snapkv", "rkv", "scissorhands", "streamingllm", "keydiff", "lookahead"):
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
    g = generate(qwen3, ids, max_new_tokens=60, policy=make_policy("random"),
                 settings=EvictionSettings(budget=16, interval=4, protect_prompt=True),
                 options=GenerateOptions(generator=torch.Generator().manual_seed(0)))
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




def test_known_full_cache_values_before_the_first_eviction_change_nothing(qwen3):
    """Evaluation hands the rollout the full cache's losses: the chunks before B + L tokens (no eviction can happen
    there) take them and skip the vocabulary projection; the rest equals a rollout that computes everything."""
    ids = torch.randint(8, 170, (3, 90))
    full = rollout(qwen3, ids)
    settings = EvictionSettings(budget=24, interval=8)
    for name in ("h2o", "streamingllm"):
        plain = rollout(qwen3, ids, make_policy(name), settings)
        fast = rollout(qwen3, ids, make_policy(name), settings,
                       options=RolloutOptions(full=(full.token_loss, full.token_entropy), entropy=False))
        assert torch.equal(fast.token_loss[:, :32], full.token_loss[:, :32])
        assert torch.allclose(fast.token_loss, plain.token_loss, atol=1e-5), name
        assert torch.allclose(fast.held_per_row, plain.held_per_row)
        assert (fast.token_entropy[:, 33:] == 0).all()  # entropy=False: losses only


def test_statistics_rows_are_only_those_the_policy_reads(qwen3):
    """StreamingLLM reads no statistic: no per-slot statistics buffer at all (it was five rows per query head, 32 GB at
    Qwen3-4B's shape with 128 sequences); H2O keeps the sums only."""
    from foresight.scorers.bank import LearnedPolicy, bank_for_model

    ids = torch.randint(8, 170, (1, 40))
    rows = {}
    for name, pol in (("streamingllm", make_policy("streamingllm")), ("h2o", make_policy("h2o")),
                      ("learned", LearnedPolicy(bank_for_model(qwen3)))):
        cache = BoundedCache(qwen3.config, pol, EvictionSettings(budget=16, interval=8))
        feed_chunks(qwen3, cache, ids)
        rows[name] = (cache.stats.rows, cache.stats.buf.numel())
    assert rows["streamingllm"] == ((), 0)
    assert rows["h2o"][0] == ("sum", "cum", "decay")
    assert rows["learned"][0] == ("max", "sum", "cum", "decay", "min") and rows["learned"][1] > rows["h2o"][1] > 0


def test_candidates_are_counted_once_per_eviction_size_without_padding(qwen3):
    """choose() checks that every row has L candidates (a host sync); without padding the same slots are candidates
    at every eviction of the same size, so the cache counts them only at the first (EvictionSettings.validate already
    refuses a budget too small for sinks + window)."""
    from benchmarks.opcount import OpCounter

    ids = torch.randint(8, 170, (1, 48))
    for chunks in (80, 160):
        with OpCounter() as c:
            cache = rollout(qwen3, ids.repeat(1, chunks // 48 + 1)[:, :chunks], make_policy("h2o"),
                            EvictionSettings(budget=16, interval=8))
        assert cache.mean_held > 0
        syncs = c.by_name.get("aten._local_scalar_dense.default", 0)
        if chunks == 80:
            first = syncs
        else:
            assert syncs == first  # 7 more evictions, not one more candidate count
