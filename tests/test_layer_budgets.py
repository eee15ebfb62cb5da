"""Per-layer budgets (``cache.layer_budgets``, foresight.engine.cache.layer_budgets): layers get unequal shares of the budget, the
mean staying B. Checked against an independent reference — dense attention in which each layer's queries see exactly
the keys StreamingLLM keeps at that layer's budget — and by the slots' contents after each eviction."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from conftest import tiny_llama, tiny_qwen3
from foresight.engine.attention import use_foresight_attention
from foresight.engine.cache.bounded import BoundedCache
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import load_recipe
from foresight.evaluation.resume import eval_identity
from foresight.evaluation.evaluate import run_eval
from foresight.engine.generate import Decoding, GenerateOptions, generate
from foresight.engine.cache.layer_budgets import HOLE, budgets, check, parse, weights
from foresight.policies import make_policy
from foresight.engine.rollout import RolloutOptions, rollout, shared_prefix

L = 4
SETTINGS = EvictionSettings(budget=12, interval=L)


def test_weights_become_budgets_that_keep_the_mean():
    assert budgets(["15-24:2"], 128, 30) == [96] * 15 + [192] * 10 + [96] * 5  # layers 15-24 at twice the others' share
    assert budgets(["*:0.5", "3:1"], 10, 4) == [8, 8, 8, 16]
    b = budgets(["0:1.3", "1-2:0.7"], 13, 5)  # largest remainders: the sum is exactly nl * B
    assert b == [18, 10, 9, 14, 14] and sum(b) == 5 * 13  # 17.98, 9.68, 9.68, 13.83, 13.83 (ties: lower layer)
    assert weights([], 3) == [1.0, 1.0, 1.0] and parse(["2-4:1.5"]) == [("2-4", 1.5)]


@pytest.mark.parametrize("bad,words", [(["18"], "LAYERS:WEIGHT"), (["a-b:2"], "LAYERS:WEIGHT"), (["3-1:2"], "LAYERS:WEIGHT"),
                                       (["1:0"], "positive weight"), (["1:nan"], "positive weight"),
                                       (["*:1", "*:2"], "listed twice")])
def test_malformed_entries_are_refused_by_name(bad, words):
    with pytest.raises(ValueError, match=words):
        SETTINGS.replace(layer_budgets=bad).validate()


def test_layers_the_model_lacks_or_budgets_without_room_are_refused(qwen3):
    with pytest.raises(ValueError, match="layer 2 .* is not a layer of this model"):
        BoundedCache(qwen3.config, make_policy("tova"), SETTINGS.replace(layer_budgets=["2:2"]))
    with pytest.raises(ValueError, match="layer 1 is listed twice"):
        weights(["0-1:2", "1:3"], 2)
    with pytest.raises(ValueError, match="layer 0 gets B=4, which must exceed the interval"):
        BoundedCache(qwen3.config, make_policy("tova"), SETTINGS.replace(layer_budgets=["1:5"]))  # 4 and 20
    with pytest.raises(ValueError, match="at least sinks \\+ window"):
        check([10, 30], 4, 4, sinks=8)


def _window_reference(model, ids, per_layer: list[int]):
    """Token losses [b, S] (the first 0, as a rollout's) of dense attention in which layer l's query t sees what
    StreamingLLM (no sinks) keeps at budget B_l when evictions come every L tokens from the smallest budget's first
    (``min B_l + L``): the newest ``B_l`` keys before the last eviction point, and the newer ones."""
    S = ids.shape[1]
    first = min(per_layer) + L
    t = torch.arange(S)
    last_evict = torch.where(t >= first, first + (t - first) // L * L, torch.zeros_like(t))

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        lo = (last_evict - per_layer[module.layer_idx]).clamp(min=0)
        j = torch.arange(S)
        vis = (j[None, :] <= t[:, None]) & (j[None, :] >= lo[:, None])
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=vis, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("layer_window_reference", attend)
    AttentionMaskInterface.register("layer_window_reference", sdpa_mask)
    model.set_attn_implementation("layer_window_reference")
    try:
        with torch.no_grad():
            logits = model(ids).logits.float()
    finally:
        use_foresight_attention(model)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return torch.cat([torch.zeros(ids.shape[0], 1), nll], 1)


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama])
def test_each_layer_sees_what_its_budget_keeps(make):
    model = make()
    ids = torch.randint(8, 170, (2, 70), generator=torch.Generator().manual_seed(0))
    settings = SETTINGS.replace(layer_budgets=["0:1", "1:2"])  # B=12: layer 0 holds 8, layer 1 16
    assert budgets(settings.layer_budgets, 12, 2) == [8, 16]
    got = rollout(model, ids, make_policy("streamingllm"), settings)
    ref = _window_reference(model, ids, [8, 16])
    assert torch.allclose(got.token_loss, ref, atol=1e-4), (got.token_loss - ref).abs().max()
    uniform = rollout(model, ids, make_policy("streamingllm"), SETTINGS)  # the reference's own check: uniform B
    assert torch.allclose(uniform.token_loss, _window_reference(model, ids, [12, 12]), atol=1e-4)
    assert (got.token_loss - uniform.token_loss).abs().max() > 1e-3


def test_after_each_eviction_layer_l_holds_its_budget_and_its_holes(qwen3):
    ids = torch.randint(8, 170, (3, 60), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :5] = False  # a left-padded row: padding still goes first, holes stay
    seen = []

    class Spy(type(make_policy("tova"))):
        def score(self, view):
            seen.append(view.token.clone())
            return super().score(view)

    settings = SETTINGS.replace(layer_budgets=["1:2"])
    out = rollout(qwen3, ids, Spy(), settings, attention_mask=mask)
    # evictions every L tokens from the smallest budget's first (12 = 8 + L): layer 0 drops to 8 at each, layer 1
    # from its own first (20 = 16 + L) on; slots are freed only above 16, so layer 0's drops become holes until then
    assert [t.shape[-1] for t in seen[:4]] == [12, 16, 20, 20] and len(seen) == (60 - 1 - 12) // L + 1
    assert [int((t[0] == HOLE).sum(-1).max()) for t in seen[:3]] == [0, 4, 8]
    for tok in seen[4:]:  # every later state: 16 + 4 slots, layer 0 with 8 holes, layer 1 with none
        holes = (tok == HOLE).sum(-1)
        assert (holes[0] == 8).all() and (holes[1] == 0).all()
        assert (tok == -1).sum() == 0  # the padded row's padding went first
        real = (tok >= 0).sum(-1)
        assert (real[0] == 8 + L).all() and (real[1] == 16 + L).all()
    # memory: after the first eviction 12 pairs on average (+ up to L), not the rectangle's 16
    assert out.mean_held < rollout(qwen3, ids, make_policy("tova"), SETTINGS.replace(budget=16),
                                   attention_mask=mask).mean_held


def test_decoding_with_layer_budgets_and_the_cache_memory(qwen3):
    ids = torch.randint(8, 170, (2, 10), generator=torch.Generator().manual_seed(2))
    settings = SETTINGS.replace(layer_budgets=["0:3"])  # 18 and 6
    out = generate(qwen3, ids, max_new_tokens=50, policy=make_policy("h2o"), settings=settings)
    cache = out.cache
    assert cache.steps > 5 and cache.holes == [0, 12]
    assert cache.mean_held() == pytest.approx(cache.n - 12 / 2)  # layer 1's 12 holes, spread over 2 layers
    real = (cache.token[:, :, :, :cache.n] >= 0).sum(-1)
    assert (real[0] == cache.n).all() and (real[1] == cache.n - 12).all()


@pytest.mark.parametrize("step", ["static", "graph"])
def test_the_static_and_recorded_steps_decode_like_the_eager_one(qwen3, step):
    ids = torch.randint(3, 50, (3, 37), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    settings = EvictionSettings(budget=24, interval=8, layer_budgets=["1:2"])  # 16 and 32
    runs = [generate(qwen3, ids, mask, max_new_tokens=50, policy=make_policy("h2o"), settings=settings,
                     decoding=Decoding(do_sample=True, top_k=20),
                     options=GenerateOptions(torch.Generator().manual_seed(0), step=s))
            for s in ("eager", step)]
    assert torch.equal(runs[1].new_tokens, runs[0].new_tokens)
    assert torch.allclose(runs[1].logprobs, runs[0].logprobs, atol=1e-5, rtol=0)
    assert torch.equal(runs[1].cache.token, runs[0].cache.token)  # holes included
    assert runs[1].cache.steps == runs[0].cache.steps > 4 and runs[1].peak_slots == 32 + 8


def test_a_shared_prefix_fork_and_whole_heads_combine(qwen3):
    ids = torch.randint(8, 170, (2, 50), generator=torch.Generator().manual_seed(3))
    settings = SETTINGS.replace(layer_budgets=["1:2"], whole_heads=["0:1"])
    a = rollout(qwen3, ids, make_policy("h2o"), settings)
    b = rollout(qwen3, ids, make_policy("h2o"), settings, options=RolloutOptions(prefix=shared_prefix(qwen3, ids, settings)))
    assert torch.equal(a.token_loss, b.token_loss) and a.mean_held == b.mean_held
    assert a.mean_held > rollout(qwen3, ids, make_policy("h2o"), SETTINGS.replace(layer_budgets=["1:2"])).mean_held


def test_recording_is_refused_and_equal_weights_are_the_uniform_cache(qwen3):
    with pytest.raises(ValueError, match="set eval.recall=false"):
        BoundedCache(qwen3.config, make_policy("tova"), SETTINGS.replace(layer_budgets=["1:2"]), recorder=print)
    flat = BoundedCache(qwen3.config, make_policy("tova"), SETTINGS.replace(layer_budgets=["*:3"]), recorder=print)
    assert flat.layer_budget is None and flat.capacity == 16
    ids = torch.randint(8, 170, (2, 40))
    assert torch.equal(rollout(qwen3, ids, make_policy("tova"), SETTINGS.replace(layer_budgets=["0-1:2"])).token_loss,
                       rollout(qwen3, ids, make_policy("tova"), SETTINGS).token_loss)


def test_settings_keys_and_eval_identity_are_unchanged_without_layer_budgets():
    import dataclasses

    plain = EvictionSettings(budget=64, interval=16)
    assert plain.key() == dataclasses.astuple(plain)[:-2]
    assert plain.replace(layer_budgets=["1:2"]).key() != plain.key()
    assert plain.replace(whole_heads=["1:0"]).key() == (*dataclasses.astuple(plain)[:-2], ("1:0",))
    recipe = load_recipe(None, ["cache.layer_budgets=15-24:2,*:1"])
    assert recipe.cache.layer_budgets == ["15-24:2", "*:1"]
    assert eval_identity(recipe)["cache"]["layer_budgets"] == ["15-24:2", "*:1"]
    assert "layer_budgets" not in eval_identity(load_recipe(None))["cache"]


def test_eval_gives_every_method_the_recipe_s_layer_budgets(tiny_model_dir, tmp_path):
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    last = cfg["num_hidden_layers"] - 1
    from test_evaluate import SETS

    sets = [f"model.path={tiny_model_dir}", "eval.recall=false", *SETS]
    kw = dict(methods="full,golden,tova", budgets="12:4", progress=False, log=lambda *_: None)
    uniform = run_eval(load_recipe("recipes/tiny-qwen3.yaml", sets), tmp_path / "uniform", **kw)
    layered = run_eval(load_recipe("recipes/tiny-qwen3.yaml", [*sets, f"cache.layer_budgets={last}:2"]),
                       tmp_path / "layered", **kw)
    for u, w in zip(uniform[1:], layered[1:]):
        assert u["method"] == w["method"] and u["loss_ratio"] != w["loss_ratio"]
        assert w["mean_cache"] <= u["mean_cache"] + 12  # the same mean budget (the rectangle's larger first block aside)
    with pytest.raises(ValueError, match="eval.recall=false"):
        run_eval(load_recipe("recipes/tiny-qwen3.yaml", [*sets[:1], *SETS, f"cache.layer_budgets={last}:2"]),
                 tmp_path / "r", **kw)


def test_a_protected_prompt_sits_on_top_of_every_layer_s_own_budget(qwen3):
    """The recommended SmolLM2 configuration: the prompt protected (as random-keep-prompt keeps it), layers at unequal
    shares and a whole head, together: every layer keeps the whole prompt in every state and at most its own B_l (+ L)
    other pairs; the whole head attends over every pair fed (so the rollout differs from the one without it)."""
    P = 10
    ids = torch.randint(8, 170, (2, 64), generator=torch.Generator().manual_seed(4))
    seen = []

    class Spy(type(make_policy("tova"))):
        def score(self, view):
            seen.append(view.token.clone())
            return super().score(view)

    settings = SETTINGS.replace(layer_budgets=["1:2"], protect_prompt=True)  # B=12: layers hold 8 and 16 + the prompt
    out = rollout(qwen3, ids, Spy(), settings.replace(whole_heads=["0:1"]), prompt_len=P)
    assert len(seen) > 5
    for tok in seen:
        assert (tok[..., :P] == torch.arange(P)).all()  # the prompt, in every layer, head and row, is never a hole
        real = (tok >= P).sum(-1)  # the pairs besides the prompt, candidates included (at most B_l + L)
        assert (real[0] <= 8 + L).all() and (real[1] <= 16 + L).all()
    assert (real[0] == 8 + L).all() and (real[1] == 16 + L).all()  # past both layers' first eviction: full
    without = rollout(qwen3, ids, make_policy("tova"), settings, prompt_len=P)
    assert out.mean_held > without.mean_held  # the whole head's store counts
    assert (out.token_loss - without.token_loss).abs().max() > 1e-4
