"""``foresight heads`` (foresight.evaluation.head_search): the KV heads to keep whole for a method, searched coarse to fine on a
traces folder's validation traces, written unit by unit and resumed after a kill."""

import json

import pytest

from foresight.data import traces
from foresight.cli import main
from foresight.config.recipe import load_recipe
from foresight.evaluation.head_search import HeadSearch, equal_memory_budget, search_heads

SETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=8",
        "traces.batch_size=4", "traces.require_correct=false", "traces.min_new_tokens=20", "traces.max_new_tokens=40",
        "sft.val_traces=2", "eval.num_problems=2"]


@pytest.fixture
def folder(tiny_model_dir, tmp_path):
    recipe = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS])
    traces.make_traces(recipe, tmp_path / "tr", progress=False, log=lambda *_: None)
    return recipe, tmp_path


def test_the_search_measures_groups_layers_and_heads_and_resumes(folder, monkeypatch):
    recipe, tmp = folder
    search = HeadSearch(group=2, top_groups=1, top_layers=1, max_heads=2)  # the tiny model: 2 layers of 2 KV heads
    res = search_heads(recipe, tmp / "tr", tmp / "heads", method="tova", budget="12:4", search=search,
                       log=lambda *_: None)
    units = res["units"]
    assert [u["level"] for u in units.values()] == ["none", "group", "layer", "layer", "head", "head"]
    base = units["none"]
    assert base["loss_ratio"] == pytest.approx(sum(base["evicted"]) / sum(base["full"]), abs=1e-5)  # the base's own
    assert sum(base["evicted"]) / sum(base["full"]) > 1.001  # B=12 of ~60 tokens loses something
    every = units["0:0,0:1,1:0,1:1"]  # the one group holds every head: nothing is lost
    assert every["loss_ratio"] == pytest.approx(1.0, abs=1e-4) and every["saving"] > 0
    for name, u in units.items():
        if name != "none":
            assert u["saving"] == pytest.approx(sum(base["evicted"]) / sum(base["full"]) - u["loss_ratio"], abs=2e-5)
    savings = [h["saving"] for h in res["ranked_heads"]]
    assert savings == sorted(savings, reverse=True) and len(savings) == 2
    # a whole head of 4 takes ~a quarter of a ~60-token trace from the others: more than B=12 has, so none is measured
    # at equal memory and none is recommended
    assert res["equal_memory"] == [] and res["recommended"]["whole_heads"] == [] and res["recommended"]["budget"] == 12
    # a rerun finds every unit in heads.json and rolls nothing out
    def no_rollout(*a, **k):
        raise AssertionError("rerun")
    monkeypatch.setattr("foresight.evaluation.head_search.rollout", no_rollout)
    again = search_heads(recipe, tmp / "tr", tmp / "heads", method="tova", budget="12:4", search=search,
                         log=lambda *_: None)
    assert again["ranked_heads"] == res["ranked_heads"] and json.loads((tmp / "heads" / "heads.json").read_text()) == again
    wider = search_heads(recipe, tmp / "tr", tmp / "heads", method="tova", budget="12:4", log=lambda *_: None,
                         search=HeadSearch(group=2, top_groups=1, top_layers=1, max_heads=1))  # the same units
    assert wider["units"] == res["units"] and wider["search"]["max_heads"] == 1


def test_a_recommendation_is_measured_at_equal_memory_and_must_pay_for_it(tmp_path):
    """On the shipped teacher (trained: eviction costs it loss), traces of ~120 tokens, B=48."""
    recipe = load_recipe("recipes/tiny-qwen3.yaml", [*SETS, "task.facts=16", "task.variables=4",
                                                     "traces.min_new_tokens=0", "traces.max_new_tokens=60"])
    traces.make_traces(recipe, tmp_path / "tr", progress=False, log=lambda *_: None)
    search = HeadSearch(group=1, top_groups=1, top_layers=2, max_heads=2)  # the teacher's 2 layers: one group each
    res = search_heads(recipe, tmp_path / "tr", tmp_path / "heads", method="tova", budget="48:4", search=search,
                       log=lambda *_: None)
    longest = res["recommended"]["longest_trace"]
    helpful = [h["head"] for h in res["ranked_heads"] if h["saving_ci"][0] > 0][:2]
    affordable = [k for k in range(1, len(helpful) + 1) if equal_memory_budget(48, 4, k, 4, longest) > 4]
    assert len(res["equal_memory"]) == len(affordable) > 0  # a set whose budget would not exceed L is not measured
    for k, option in enumerate(res["equal_memory"], 1):
        assert option["whole_heads"] == helpful[:k]
        assert option["budget"] == equal_memory_budget(48, 4, k, 4, longest) < 48
    # the best group's layers at 1.5, 2 and 3 times the others' share, at B itself (the mean budget stays 48)
    groups = [u for u in res["units"].values() if u["level"] == "group"]
    top = max(groups, key=lambda u: u["saving"])["heads"]
    layer = top[0][0]
    shares = [u for u in res["units"].values() if u["level"] == "layer shares"]
    assert [u["layer_budgets"] for u in shares] == [[f"{layer}:{w}"] for w in ("1.5", "2", "3")]
    assert all(u["budget"] == 48 and u["heads"] == [] for u in shares)
    # the recommendation: the largest separated saving of every kind measured
    options = [(o["saving"], o["whole_heads"], o["budget"], []) for o in res["equal_memory"] if o["saving_ci"][0] > 0]
    options += [(u["saving"], [f"{a}:{b}" for a, b in u["heads"]], u["budget"], u["layer_budgets"])
                for u in res["units"].values() if u["level"] in ("layer shares", "heads and shares")
                and u["saving_ci"][0] > 0]
    rec = res["recommended"]
    got = (rec["saving"], rec["whole_heads"], rec["budget"], rec["layer_budgets"])
    assert got == (max(options, key=lambda o: o[0]) if options else (0.0, [], 48, []))


def test_equal_memory_budget_counts_the_whole_heads_pairs():
    assert equal_memory_budget(128, 32, 1, 90, 1230) == 128 - 14  # 1230 pairs spread over 90 heads: 13.7
    assert equal_memory_budget(128, 32, 0, 90, 1230) == 128


def test_bad_requests_are_refused(folder, capsys):
    recipe, tmp = folder
    with pytest.raises(ValueError, match="one method"):
        search_heads(recipe, tmp / "tr", tmp / "h1", log=lambda *_: None)
    with pytest.raises(ValueError, match="does not evict by its own scores"):
        search_heads(recipe, tmp / "tr", tmp / "h2", method="golden", budget="12:4", log=lambda *_: None)
    with pytest.raises(ValueError, match="one budget"):
        search_heads(recipe, tmp / "tr", tmp / "h3", method="tova", budget="12:4,16:4", log=lambda *_: None)
    code = main(["heads", "--traces", str(tmp / "tr"), "--method", "tova", "--max-heads", "0", "--out", str(tmp / "h4"),
                 "--set", f"model.path={recipe.model.path}"])
    assert code == 2 and "max_heads must be > 0" in capsys.readouterr().err
    code = main(["heads", "--traces", str(tmp / "tr"), "--method", "tova", "--shares", "2,x", "--out", str(tmp / "h5"),
                 "--set", f"model.path={recipe.model.path}"])
    assert code == 2 and "--shares: '2,x' is not a comma-separated list" in capsys.readouterr().err
    with pytest.raises(ValueError, match="every share must be > 1"):
        HeadSearch(shares=(0.5,)).validate()
