import pytest

from foresight.config.recipe import RecipeError, load_recipe
from foresight.config.checks import parse_budgets

R = "recipes/tiny-qwen3.yaml"


@pytest.mark.parametrize("override, message", [
    ("cache.interval=0", "eviction interval must be > 0"),
    ("cache.sinks=-1", "sinks must be >= 0"),
    ("cache.selection=foo", "selection must be one of topk, sample, multinomial"),
    ("sft.ckpt_every=0", "sft.ckpt_every=0: must be >= 1"),
    ("grpo.ckpt_every=0", "grpo.ckpt_every=0: must be >= 1"),
    ("traces.batch_size=0", "traces.batch_size=0: must be >= 1"),
    ("sft.batch_traces=0", "sft.batch_traces=0: must be >= 1"),
    ("sft.steps=-5", "sft.steps=-5: must be >= 1"),
    ("sft.steps=0", "sft.steps=0: must be >= 1"),
    ("grpo.steps=0", "grpo.steps=0: must be >= 1"),
    ("eval.budgets=0:0", "interval L must be > 0"),
    ("eval.methods=' , '", "eval.methods=' , ': names no method"),
    ("sft.steps=nan", "sft.steps: expected an integer"),
    ("sft.lr=inf", "sft.lr: expected a finite number"),
    ("sft.steps=[1", "not valid YAML"),
    ("model.device=gpu", "model.device='gpu'"),
    ("scorer.features=[age]", "must hold key, value or attn besides age"),
    ("scorer.features=[key,position]", "must be a non-empty list of key, value, attn, heads, ahead, age"),
])
def test_bad_values_are_refused_when_the_recipe_is_read(override, message):
    with pytest.raises(RecipeError, match=message.replace("[", "\\[").replace("(", "\\(")):
        load_recipe(R, [override])


def test_every_problem_is_named_at_once_and_good_recipes_pass(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_recipe(R, ["sft.steps=0", "grpo.group=1"])
    assert "sft.steps=0" in str(e.value) and "grpo.group=1" in str(e.value)
    for r in ("tiny-qwen3", "smollm2-135m", "qwen3-4b", "qwen3-1.7b", "r1-distill-qwen-7b"):
        load_recipe(f"recipes/{r}.yaml")
    with pytest.raises(RecipeError, match="is not a file"):
        load_recipe(tmp_path)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="the recipe: expected a mapping"):
        load_recipe(tmp_path / "list.yaml")
    assert parse_budgets("320:64, 640:128") == [(320, 64), (640, 128)]


def test_eval_methods_are_checked_before_any_work():
    from foresight.evaluation.methods import check_names

    with pytest.raises(ValueError, match="no evaluation method"):
        check_names(",".split(","))
    with pytest.raises(ValueError, match="unknown eviction policy 'h20'"):
        check_names(["full", "h20"])
    assert check_names([" full", "h2o ", ""]) == ["full", "h2o"]
