import json

from foresight.config import load_recipe
from foresight.evaluate import run_eval
from foresight.sft import train_sft
from foresight import traces

SETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=6",
        "traces.batch_size=3", "traces.require_correct=false", "traces.min_new_tokens=5", "traces.max_new_tokens=24",
        "cache.budget=12", "cache.interval=4", "sft.steps=2", "sft.batch_traces=2", "eval.num_problems=3"]


def test_eval_writes_results_tables_and_plots_reproducibly(tiny_model_dir, tmp_path):
    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS])
    traces.make_traces(r, tmp_path / "tr", progress=False, log=lambda *_: None)
    train_sft(r, tmp_path / "tr", tmp_path / "sft", progress=False, log=lambda *_: None)
    methods = "full,golden,random,streamingllm,h2o,tova,snapkv,rkv,scissorhands,knorm,keydiff,random-keep-prompt"
    rows = run_eval(r, tmp_path / "ev", methods=methods, budgets="12:4,24:4", scorers=[tmp_path / "sft"],
                    progress=False, log=lambda *_: None)
    names = {x["method"] for x in rows}
    assert names == set(methods.split(",")) | {"foresight-sft"}
    # random-keep-prompt protects the 21-token prompt: impossible at B=12 (skipped, cache.prompt_overflow=error)
    assert len(rows) == 2 * 13 - 1
    assert not any(x["method"] == "random-keep-prompt" and x["budget"] == 12 for x in rows)
    for x in rows:
        for k in ("method", "budget", "interval", "loss_ratio", "accuracy", "n_samples",
                  "low_entropy_loss_increase", "high_entropy_loss_increase"):
            assert k in x
        if x["method"] == "full":
            assert x["loss_ratio"] == 1.0
        if x["method"] == "golden":
            assert x["accuracy"] is None
        if x["method"] not in ("full", "random-keep-prompt"):
            assert x["mean_cache"] <= x["budget"] + x["interval"]
    rkp = next(x for x in rows if x["method"] == "random-keep-prompt")
    assert rkp["protect_prompt"] is True and rkp["budget"] == 24
    for f in ("results.json", "results.md", "accuracy.png", "loss_ratio.png", "eviction_map.png"):
        assert (tmp_path / "ev" / f).exists(), f
    again = run_eval(r, tmp_path / "ev2", methods="golden,random,h2o", budgets="12:4,24:4", scorers=[tmp_path / "sft"],
                     progress=False, log=lambda *_: None)
    assert again == [x for x in rows if x["method"] in ("golden", "random", "h2o", "foresight-sft")]
    assert json.loads((tmp_path / "ev" / "results.json").read_text()) == rows
    card = (tmp_path / "sft" / "README.md").read_text()
    assert "## Evaluation" in card and "12:4" in card  # the model card carries the scorer's eval rows
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["eval"][0]["method"] == "foresight-sft"
