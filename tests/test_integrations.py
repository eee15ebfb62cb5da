import pytest
import torch

from conftest import tiny_llama, tiny_qwen3
from foresight.scorers.checkpoint import ScorerMismatchError, save_scorer
from foresight.config.eviction import EvictionSettings
from foresight.engine.generate import generate
from foresight.integrations.hf import ForesightCache
from foresight.engine.models import describe
from foresight.scorers.bank import LearnedPolicy, bank_for_model


def checkpoint(model, path, features=("key", "value", "attn")):
    bank = bank_for_model(model, seed=3, features=features)
    save_scorer(bank, path, describe(model), budget=16, interval=4, sinks=0, stage="sft")
    return bank


@pytest.mark.parametrize("make,features", [(tiny_qwen3, ("key", "value", "attn")), (tiny_llama, ("key", "value", "attn")),
                                           (tiny_qwen3, ("key", "value", "attn", "age")),
                                           (tiny_llama, ("key", "value", "attn", "heads")),
                                           (tiny_qwen3, ("key", "value", "attn", "ahead"))])
def test_from_pretrained_cache_works_in_plain_generate(make, features, tmp_path):
    model = make()
    bank = checkpoint(model, tmp_path / "ck", features)
    ids = torch.randint(8, 170, (1, 10))
    cache = ForesightCache.from_pretrained(tmp_path / "ck", model)
    out = model.generate(ids, cache=cache, max_new_tokens=40, do_sample=False)
    assert out.shape == (1, 50) and cache.steps >= 8 and cache.held() <= 16 + 4
    # the same decisions as the project's own generation driver with the same scorers
    mine = generate(model, ids, max_new_tokens=40, policy=LearnedPolicy(bank), settings=EvictionSettings(budget=16, interval=4))
    assert torch.equal(out, mine.sequences)


def test_from_pretrained_refuses_another_model(tmp_path):
    checkpoint(tiny_qwen3(), tmp_path / "ck")
    with pytest.raises(ScorerMismatchError, match="num_attention_heads: checkpoint 4 vs model 6"):
        ForesightCache.from_pretrained(tmp_path / "ck", tiny_llama())


def test_sampler_option_is_seeded(tmp_path):
    model = tiny_qwen3()
    checkpoint(model, tmp_path / "ck")
    ids = torch.randint(8, 170, (1, 10))
    outs = []
    for _ in range(2):
        c = ForesightCache.from_pretrained(tmp_path / "ck", model, selection="sample", seed=5)
        outs.append(model.generate(ids, cache=c, max_new_tokens=30, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def test_whole_heads_reach_plain_generate(tmp_path):
    """whole_heads=... in from_pretrained: transformers' generate decodes as the project's driver does with them."""
    model = tiny_qwen3()
    bank = checkpoint(model, tmp_path / "ck")
    ids = torch.randint(8, 170, (1, 10), generator=torch.Generator().manual_seed(4))
    cache = ForesightCache.from_pretrained(tmp_path / "ck", model, whole_heads=["1:0"])
    out = model.generate(ids, cache=cache, max_new_tokens=40, do_sample=False)
    assert cache.whole is not None and cache.whole.pairs() == 49 and cache.held() <= 16 + 4
    mine = generate(model, ids, max_new_tokens=40, policy=LearnedPolicy(bank),
                    settings=EvictionSettings(budget=16, interval=4, whole_heads=["1:0"]))
    assert torch.equal(out, mine.sequences)


def test_layer_budgets_reach_plain_generate(tmp_path):
    """layer_budgets=... in from_pretrained: transformers' generate decodes as the project's driver does with them."""
    model = tiny_qwen3()
    bank = checkpoint(model, tmp_path / "ck")
    ids = torch.randint(8, 170, (1, 10), generator=torch.Generator().manual_seed(4))
    cache = ForesightCache.from_pretrained(tmp_path / "ck", model, layer_budgets=["1:2"])  # 11 and 21 of B=16
    out = model.generate(ids, cache=cache, max_new_tokens=40, do_sample=False)
    assert cache.holes == [10, 0] and cache.layer_budget == [11, 21] and cache.held() <= 21 + 4
    mine = generate(model, ids, max_new_tokens=40, policy=LearnedPolicy(bank),
                    settings=EvictionSettings(budget=16, interval=4, layer_budgets=["1:2"]))
    assert torch.equal(out, mine.sequences)
