"""``make demo`` reuses a finished stage only when it was trained by the recipe's current settings."""

import json
from pathlib import Path

import pytest

from foresight.config.recipe import load_recipe
from foresight.pipelines.demo import GRPO_SECTIONS, SFT_SECTIONS, main, stale_settings

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-qwen3.yaml"


def _finished(stage_dir: Path, recipe_dict: dict) -> None:
    stage_dir.mkdir(parents=True)
    (stage_dir / "config.json").write_text(json.dumps({"stage": stage_dir.name, "recipe": recipe_dict}))


def test_same_settings_are_reused_and_changes_are_named(tmp_path):
    recipe = load_recipe(RECIPE, [])
    _finished(tmp_path / "sft", recipe.to_dict())
    assert stale_settings(tmp_path / "sft", recipe, SFT_SECTIONS) == []
    assert stale_settings(tmp_path / "nothing-here", recipe, GRPO_SECTIONS) == []
    old = recipe.to_dict()
    old["grpo"]["traces_per_step"], old["grpo"]["steps"] = 2, 5
    old["sft"]["lr"] = 0.5  # not a GRPO section: a GRPO checkpoint does not depend on it directly
    _finished(tmp_path / "grpo", old)
    changes = stale_settings(tmp_path / "grpo", recipe, GRPO_SECTIONS)
    assert f"grpo.traces_per_step: 2 -> {recipe.grpo.traces_per_step}" in changes
    assert f"grpo.steps: 5 -> {recipe.grpo.steps}" in changes
    assert not any(c.startswith("sft.") for c in changes)
    moved = load_recipe(RECIPE, ["model.device=cpu"])  # where it runs is not a training setting
    assert stale_settings(tmp_path / "sft", moved, SFT_SECTIONS) == []


def test_demo_stops_before_running_anything_on_a_stale_checkpoint(tmp_path, capsys):
    recipe = load_recipe(RECIPE, [])
    old = recipe.to_dict()
    old["scorer"]["hidden"] = recipe.scorer.hidden * 2
    _finished(tmp_path / "sft", old)
    with pytest.raises(SystemExit, match=r"scorer\.hidden: .*move it away"):
        main(["--recipe", str(RECIPE), "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]  # no traces generated, nothing overwritten
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["recipe"]["scorer"]["hidden"] == old["scorer"]["hidden"]
