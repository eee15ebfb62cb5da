"""The data-scaling study (studies/data_scaling.py): nested training sets of one traces folder, the same validation
traces and references for every size, and its report, end to end on a tiny model."""

import json
from pathlib import Path

import pytest

from foresight.config.recipe import load_recipe
from foresight.data.stage_inputs import load_stage_inputs
from foresight.evaluation import evaluate
from foresight.training import sft
from foresight.training.golden_store import GoldenStore
from studies import data_scaling
from studies import scaling_headline as headline

ROOT = Path(__file__).resolve().parents[1]


def test_steps_grow_with_the_data_from_a_floor():
    assert [data_scaling.steps_for(n, 300, 264) for n in (66, 132, 264, 528, 1056)] == [150, 150, 300, 600, 1200]
    assert data_scaling.steps_for(10, 2, 264) == 1


def test_the_runs_add_the_reference_size_at_the_largest_size_s_steps_and_the_wider_scorer():
    study = data_scaling.Scaling(ROOT / "recipes/smollm2-135m-realbench.yaml", (), Path("o"), Path("r"))
    assert [(name, n, sets[1]) for name, n, sets in study.runs()] == [
        ("sft-66", 66, "sft.steps=150"), ("sft-132", 132, "sft.steps=150"), ("sft-264", 264, "sft.steps=300"),
        ("sft-528", 528, "sft.steps=600"), ("sft-1056", 1056, "sft.steps=1200"),
        ("sft-264-steps1200", 264, "sft.steps=1200"), ("sft-1056-wide", 1056, "sft.steps=1200")]
    assert study.runs()[-1][2][-1] == "scorer.hidden=512"
    same = data_scaling.Scaling(ROOT / "recipes/smollm2-135m-realbench.yaml", (), Path("o"), Path("r"), sizes=(66, 132),
                                reference=66)
    assert [name for name, _, _ in same.runs()] == ["sft-66", "sft-132", "sft-132-wide"]  # equal steps: no control


def test_a_report_of_a_study_still_running_says_what_it_lacks(tmp_path):
    from studies.scaling_report import write_report

    study = data_scaling.Scaling(ROOT / "recipes/smollm2-135m-realbench.yaml", (), tmp_path / "out", tmp_path / "rep",
                                 sizes=(66, 132))
    (tmp_path / "out").mkdir()
    write_report(study)
    md = (tmp_path / "rep/README.md").read_text()
    assert "**Incomplete:** not trained yet: sft-66, sft-132, sft-132-wide; the heuristics and golden are not " \
           "evaluated yet." in md
    assert "scaling.png" not in md and not (tmp_path / "rep/scaling.png").exists()


def test_train_traces_keeps_the_first_training_traces_and_the_same_validation(tiny_model_dir, tmp_path, monkeypatch):
    from foresight.data.traces import make_traces

    sets = [f"model.path={tiny_model_dir}", "traces.num_prompts=8", "traces.batch_size=8",
            "traces.require_correct=false", "traces.min_new_tokens=1", "traces.max_new_tokens=12", "sft.val_traces=2"]
    recipe = load_recipe(ROOT / "recipes/tiny-qwen3.yaml", sets)
    make_traces(recipe, tmp_path / "traces", progress=False, log=lambda *_: None)
    _, _, _, every, val = load_stage_inputs(recipe.sft, recipe.model, tmp_path / "traces", 1)
    three = load_recipe(ROOT / "recipes/tiny-qwen3.yaml", sets + ["sft.train_traces=3"])
    _, _, _, first, val3 = load_stage_inputs(three.sft, three.model, tmp_path / "traces", 1)
    assert every == list(range(6)) and first == [0, 1, 2] and val == val3 == [6, 7]
    too_many = load_recipe(ROOT / "recipes/tiny-qwen3.yaml", sets + ["sft.train_traces=7"])
    with pytest.raises(ValueError, match="sft.train_traces=7, but .* holds 6 training traces"):
        load_stage_inputs(too_many.sft, too_many.model, tmp_path / "traces", 1)


@pytest.mark.slow
def test_the_study_runs_end_to_end_and_reports_every_size(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache"))
    sets = (f"model.path={tiny_model_dir}", "task.facts=4", "task.variables=2", "task.scratch=0",
            "traces.batch_size=4", "traces.require_correct=false", "traces.min_new_tokens=5",
            "traces.max_new_tokens=40", "traces.min_tokens=30", "cache.budget=12", "cache.interval=4",
            "sft.steps=8", "sft.batch_traces=2", "sft.ckpt_every=2", "sft.example_steps=2")
    study = data_scaling.Scaling(ROOT / "recipes/tiny-qwen3.yaml", sets, tmp_path / "sc", tmp_path / "report",
                                 sizes=(2, 6), val=2, problems=3, budgets="8:4,16:4", wide="scorer.hidden=32",
                                 methods="full,golden,h2o,streamingllm", reference=2, base_traces=6,
                                 allocation=("cache.layer_budgets=1:1.25", "cache.whole_heads=1:0",
                                             "eval.protect_prompt=true", "cache.prompt_overflow=evict"),
                                 allocated="7,14")
    data_scaling.run(study)
    assert [r[0] for r in study.runs()] == ["sft-2", "sft-6", "sft-2-steps8", "sft-6-wide"]  # 4 steps at 2, 8 at 6
    stored = list((tmp_path / "cache" / "golden").rglob("trace-*.pt"))
    assert len(stored) == 8  # the golden stage stored every training and validation trace, once, for every run
    for name, n, _ in study.runs():
        metrics = json.loads((tmp_path / "sc" / name / "metrics.json").read_text())
        assert metrics["val_traces"] == 2
    res = json.loads((tmp_path / "report/results.json").read_text())
    assert set(res) == {"8", "16"}
    for budget in res.values():
        assert set(budget["methods"]) == {"full", "golden", "h2o", "streamingllm"}
        assert [(s[0], s[1]) for s in budget["sizes"]] == [("sft-2", 2), ("sft-6", 6), ("sft-2-steps8", 2),
                                                           ("sft-6-wide", 6)]
        refs = {tuple(s[2]["per_trace"]["full_loss"]) for s in budget["sizes"]}
        assert len(refs) == 1  # every size on the same references
    md = (tmp_path / "report/README.md").read_text()
    assert (tmp_path / "report/scaling.png").stat().st_size > 0 and "### B = 8" in md and "| sft-6-wide | 6 |" in md
    assert "More steps at 2 traces (8 against 4): sft-2-steps8 − sft-2 (paired): " in md
    assert "More data at 8 steps (6 traces against 2): sft-6 − sft-2-steps8 (paired): " in md
    assert "A wider scorer at 6 traces: sft-6-wide − sft-6 (paired): " in md
    assert "The curve's last step (6 traces against 2): sft-6 − sft-2 (paired): " in md
    assert "| golden |" in md and "| sft sft-6 |" in md  # the cost section
    assert "**Incomplete:**" not in md and " --sizes 2,6 --val 2 " in md  # the command as a shell takes it
    for name, _, sets in study.runs():  # the validation curve at every snapshot, its end the run's own validation
        curve, end = json.loads((tmp_path / "sc" / name / "val_curve.json").read_text()), sets[1].split("=")[1]
        assert list(curve) == [str(k) for k in range(2, int(end) + 1, 2)]
        assert all(len(v["lost_future"]) == 2 for v in curve.values())
        metrics = json.loads((tmp_path / "sc" / name / "metrics.json").read_text())
        assert abs(sum(curve[end]["lost_future"]) / 2 - metrics["val_lost_future_ratio"]) < 1e-3
    assert "## Convergence on the validation traces" in md and "| sft-6 | 6 | 4 → 8 | " in md
    assert "![validation curves](val_curves.png)" in md and (tmp_path / "report/val_curves.png").stat().st_size > 0
    best = headline.best_run(study)  # the headline: the best point and the heuristics at 2 x 16, the allocation's runs
    assert best in {name for name, _, _ in study.runs()}
    assert {(r["method"], r["budget"]) for r in json.loads((tmp_path / "sc/headline-32/results.json").read_text())} == {
        ("full", 32), ("h2o", 32), ("streamingllm", 32), ("foresight-sft", 32)}
    head = json.loads((tmp_path / "report/headline.json").read_text())
    assert head["best"] == best and set(head["allocated_runs"]) == {best, "sft-6", "sft-2"}
    for rows in head["allocated_runs"].values():
        assert {(r["method"], r["budget"]) for r in rows} == {("full", 7), ("full", 14), ("foresight-sft", 7),
                                                              ("foresight-sft", 14)}
    assert f"## The 2B headline at the best point: {best}" in md and "| 32 | " in md
    assert "| sft-6 | 7 (8) | " in md and "| sft-6 | 14 (16) | " in md  # B' against the best heuristic at 2B

    def computed():  # the stored golden examples and the trained runs, with the time each file was last written
        files = [f for top in ("cache", *(f"sc/{name}" for name, _, _ in study.runs())) for f in (tmp_path / top).rglob("*")]
        return {f: f.stat().st_mtime_ns for f in files if f.is_file()}

    def nothing_computed(*_):
        raise AssertionError("a finished study computed again")

    before = computed()
    monkeypatch.setattr(GoldenStore, "compute_batch", nothing_computed)
    monkeypatch.setattr(sft, "rows_loss", nothing_computed)
    monkeypatch.setattr(evaluate, "evaluate_row", nothing_computed)
    data_scaling.run(study)  # finished: nothing is computed, trained or evaluated again (the reports are rewritten)
    assert computed() == before
