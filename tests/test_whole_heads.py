"""Whole heads (``cache.whole_heads``, foresight.engine.cache.whole_heads): chosen KV heads keep every pair while the others are
bounded. With every head whole the bounded cache must compute what the full cache does; with one, that head's store
must hold exactly the full cache's pairs, and the memory it holds must be counted."""

import pytest
import torch

from conftest import tiny_llama, tiny_qwen3
from foresight.engine.cache.bounded import BoundedCache
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import load_recipe
from foresight.evaluation.resume import eval_identity
from foresight.engine.generate import generate
from foresight.policies import make_policy
from foresight.engine.rollout import RolloutOptions, rollout, shared_prefix
from foresight.engine.static_step import StaticDecoder
from foresight.engine.cache.whole_heads import parse

SMALL = EvictionSettings(budget=16, interval=4)


def every_head(model) -> list[str]:
    cfg = model.config
    return [f"{layer}:{h}" for layer in range(cfg.num_hidden_layers) for h in range(cfg.num_key_value_heads)]


def padded_batch(seed: int = 0):
    ids = torch.randint(8, 170, (3, 90), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :9] = False  # a left-padded row
    return ids, mask


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama])
@pytest.mark.parametrize("policy", ["h2o", "streamingllm"])  # explicit probabilities / fused attention
def test_every_head_whole_equals_the_full_cache(make, policy):
    model = make()
    ids, mask = padded_batch()
    full = rollout(model, ids, attention_mask=mask)
    bounded = rollout(model, ids, make_policy(policy), SMALL, attention_mask=mask)
    whole = rollout(model, ids, make_policy(policy), SMALL.replace(whole_heads=every_head(model)), attention_mask=mask)
    assert (bounded.token_loss - full.token_loss).abs().max() > 1e-2  # B=16 of 90 tokens does lose something
    assert torch.allclose(whole.token_loss, full.token_loss, atol=1e-4)
    assert torch.allclose(whole.token_entropy, full.token_entropy, atol=1e-4)
    assert whole.peak_slots == bounded.peak_slots == 16 + 4  # the slots stay bounded; the store holds the rest


def test_every_head_whole_decodes_like_the_full_cache(qwen3):
    ids = torch.randint(8, 170, (2, 12), generator=torch.Generator().manual_seed(2))
    full = generate(qwen3, ids, max_new_tokens=40)
    whole = generate(qwen3, ids, max_new_tokens=40, policy=make_policy("tova"),
                     settings=SMALL.replace(whole_heads=every_head(qwen3)))
    assert whole.cache.steps > 5
    assert torch.equal(whole.sequences, full.sequences)
    assert torch.allclose(whole.logprobs, full.logprobs, atol=1e-4)


def test_one_whole_head_holds_the_full_caches_pairs_and_counts_its_memory():
    model = tiny_qwen3(layers=2, kv_heads=2, heads=4)
    ids, mask = padded_batch(1)
    settings = SMALL.replace(whole_heads=["0:1"])  # layer 0: its keys do not depend on evictions
    out = generate(model, ids[:, :30], mask[:, :30], max_new_tokens=40, policy=make_policy("tova"), settings=settings)
    cache = out.cache
    assert cache.steps > 5 and cache.n <= 20
    with torch.no_grad():  # the same tokens through the plain model: its keys of layer 0, KV head 1
        am = torch.cat([mask[:, :30], torch.ones(3, 39, dtype=torch.bool)], 1)
        pos = (am.long().cumsum(1) - 1).clamp(min=0)  # a padded row's positions start at its first real token
        ref = model(out.sequences[:, :-1], attention_mask=am, position_ids=pos, use_cache=True).past_key_values
    T = out.sequences.shape[1] - 1
    keys, tok = cache.whole.keys[0][:, 0, :T], cache.whole.token[0][:, 0, :T]
    assert cache.whole.pairs() == T and list(cache.whole.by_layer) == [0]
    assert torch.equal(tok[0], torch.arange(T)) and (tok[1, :9] == -1).all()  # padding marked as in the slots
    real = tok >= 0
    assert torch.allclose(keys[real], ref.layers[0].keys[:, 1][real], atol=1e-5)
    # memory: the slots of every head plus the store's pairs, spread over the 4 (layer, KV head) pairs
    assert cache.mean_held() == pytest.approx(cache.n + T / 4)
    slots_only = generate(model, ids[:, :30], mask[:, :30], max_new_tokens=40, policy=make_policy("tova"),
                          settings=SMALL)
    assert cache.cache_bytes() > slots_only.cache.cache_bytes()
    assert not torch.equal(out.sequences, slots_only.sequences) or not torch.allclose(
        out.logprobs, slots_only.logprobs)  # the whole head changes what the model computes


def test_rollout_reports_the_memory_of_the_whole_heads(qwen3):
    ids, mask = padded_batch(2)
    plain = rollout(qwen3, ids, make_policy("tova"), SMALL)
    whole = rollout(qwen3, ids, make_policy("tova"), SMALL.replace(whole_heads=["0:1"]))
    assert whole.mean_held > plain.mean_held + 5  # one of 4 heads holds up to 90 pairs instead of <= 20


def test_bad_whole_heads_are_refused_with_the_entry_named(qwen3):
    for bad, words in ((["18"], "LAYER:HEAD"), (["a:b"], "LAYER:HEAD"), (["1:-1"], "negative"),
                       (["0:1", "0:1"], "twice")):
        with pytest.raises(ValueError, match=words):
            SMALL.replace(whole_heads=bad).validate()
    with pytest.raises(ValueError, match="2:0 is not a KV head of this model"):
        BoundedCache(qwen3.config, make_policy("tova"), SMALL.replace(whole_heads=["2:0"]))
    assert parse(["1:0", "0:1"]) == [(0, 1), (1, 0)]


def test_recipes_set_whole_heads_and_older_evaluations_still_resume():
    recipe = load_recipe(None, ["cache.whole_heads=1:0,0:1"])
    assert recipe.cache.whole_heads == ["1:0", "0:1"]
    assert eval_identity(recipe)["cache"]["whole_heads"] == ["1:0", "0:1"]
    assert "whole_heads" not in eval_identity(load_recipe(None))["cache"]  # run.json written before the field existed


def test_the_static_step_refuses_whole_heads(qwen3):
    ids = torch.randint(8, 170, (1, 30))
    out = generate(qwen3, ids, max_new_tokens=2, policy=make_policy("tova"), settings=SMALL.replace(whole_heads=["0:0"]))
    with pytest.raises(ValueError, match="whole_heads is not supported"):
        StaticDecoder(qwen3, out.cache)


def test_a_rollout_from_a_shared_prefix_makes_its_own_store_bit_for_bit(qwen3):
    ids, mask = padded_batch(3)
    settings = SMALL.replace(whole_heads=["1:1"])
    a = rollout(qwen3, ids, make_policy("h2o"), settings, attention_mask=mask)
    prefix = shared_prefix(qwen3, ids, settings, attention_mask=mask)
    b = rollout(qwen3, ids, make_policy("h2o"), settings, attention_mask=mask, options=RolloutOptions(prefix=prefix))
    assert torch.equal(a.token_loss, b.token_loss) and a.mean_held == b.mean_held


def test_settings_keys_are_hashable_and_unchanged_without_whole_heads():
    import dataclasses

    plain = EvictionSettings(budget=64, interval=16)
    assert plain.key() == dataclasses.astuple(plain)[:-2]  # golden stores and evaluations keyed before stay valid
    keyed = {plain.replace(whole_heads=["1:0"]).key(): 1}
    assert plain.replace(whole_heads=["1:0"]).key() in keyed and plain.key() not in keyed
