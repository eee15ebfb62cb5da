"""The evaluation under recipe settings: without recall, with every prompt protected, on validation traces, with
shared prefixes, with whole heads."""

import json
import shutil

import pytest
from test_evaluate import SETS  # noqa: F401 (fixtures and settings shared with test_evaluate)

from foresight.config.recipe import load_recipe
from foresight.data import traces
from foresight.evaluation.evaluate import run_eval
from foresight.training.sft import train_sft


def test_eval_without_recall_computes_no_golden_labels_and_the_same_loss_ratios(tiny_model_dir, tmp_path, monkeypatch):
    """eval.recall=false: the heuristics' rows without golden's labels (never computed) or recall columns, their
    losses as with recall; golden itself still gets its labels."""
    from foresight.evaluation import labels as eval_labels

    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS])
    with_recall = run_eval(r, tmp_path / "ev", methods="full,h2o,tova", budgets="12:4", progress=False,
                           log=lambda *_: None)
    labels = eval_labels.block_pooled_attention
    monkeypatch.setattr(eval_labels, "block_pooled_attention",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("golden labels computed")))
    quick = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "eval.recall=false"])
    rows = run_eval(quick, tmp_path / "quick", methods="full,h2o,tova", budgets="12:4", progress=False,
                    log=lambda *_: None)
    assert [x["method"] for x in rows] == ["full", "h2o", "tova"]
    for a, b in zip(rows[1:], with_recall[1:]):
        assert a["recall_at_L"] is None and a["keep_recall"] is None and b["recall_at_L"] is not None
        assert a["loss_ratio"] == b["loss_ratio"] and a["per_trace"] == b["per_trace"]
    with pytest.raises(ValueError, match="another evaluation"):  # recall's rows cannot extend an evaluation without
        run_eval(r, tmp_path / "quick", methods="full,h2o,tova", budgets="12:4", progress=False, log=lambda *_: None)
    monkeypatch.setattr(eval_labels, "block_pooled_attention", labels)
    golden = run_eval(quick, tmp_path / "golden", methods="golden", budgets="12:4", progress=False, log=lambda *_: None)
    assert golden[0]["loss_ratio"] < rows[1]["loss_ratio"]


def test_eval_with_every_prompt_protected_draws_golden_from_its_own_labels(tiny_model_dir, tmp_path):
    """eval.protect_prompt=true: golden's labels are keyed by the protected prompt (their blocks start at P + B, see
    test_golden), and the eviction map, drawn for golden when no scorer is evaluated, finds them."""
    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "eval.protect_prompt=true",
                                                "traces.max_new_tokens=40"])
    rows = run_eval(r, tmp_path / "ev", methods="full,golden,h2o,streamingllm", budgets="24:8", progress=False,
                    log=lambda *_: None)
    assert [x["protect_prompt"] for x in rows] == [False, True, True, True]  # the full cache keeps everything anyway
    assert all(x["mean_cache"] > 24 for x in rows)  # the 21-token prompt is held besides the budget
    assert (tmp_path / "ev" / "eviction_map.png").exists()


def test_eval_on_validation_traces_uses_the_held_out_split_and_refuses_a_scorer_trained_on_it(tiny_model_dir, tmp_path):
    """eval.traces: the last sft.val_traces traces of a traces folder are the references (their stored full-cache
    losses, nothing generated); a scorer trained on that folder holding out fewer traces is refused."""
    from foresight.data.trace_data import load_traces

    sets = [f"model.path={tiny_model_dir}", *SETS, "traces.num_prompts=8", "sft.val_traces=2"]
    r = load_recipe("recipes/tiny-qwen3.yaml", sets)
    traces.make_traces(r, tmp_path / "tr", progress=False, log=lambda *_: None)
    train_sft(r, tmp_path / "tr", tmp_path / "sft", progress=False, log=lambda *_: None)
    ds = load_traces(tmp_path / "tr")
    val = [ds[i] for i in (6, 7)]
    v = load_recipe("recipes/tiny-qwen3.yaml", [*sets, f"eval.traces={tmp_path / 'tr'}"])
    rows = run_eval(v, tmp_path / "ev", methods="full,h2o", budgets="12:4", scorers=[tmp_path / "sft"],
                    progress=False, log=lambda *_: None)
    meta = json.loads((tmp_path / "ev" / "meta.json").read_text())
    assert meta["num_problems"] == 2 and meta["references"].startswith("validation traces of")
    assert "not the held-out set" in (tmp_path / "ev" / "results.md").read_text()
    stored = sorted(sum(x["token_loss"][x["prompt_len"]:]) for x in val)
    for x in rows:  # every method's full-cache sums are the validation traces' own stored losses
        assert sorted(x["per_trace"]["full_loss"]) == pytest.approx(stored, rel=1e-4)
    full = next(x for x in rows if x["method"] == "full")  # greedy traces: the rebuilt prompts regenerate them
    assert full["accuracy"] == pytest.approx(sum(bool(x["correct"]) for x in val) / 2)
    assert {x["method"] for x in rows} == {"full", "h2o", "foresight-sft"}
    # the same evaluation on held-out references has other traces
    held = run_eval(r, tmp_path / "held", methods="full", budgets="12:4", progress=False, log=lambda *_: None)
    assert not any(h == pytest.approx(s, rel=1e-6) for h in held[0]["per_trace"]["full_loss"] for s in stored)
    from foresight.cli import main as cli_main

    argv = ["eval", "--recipe", "recipes/tiny-qwen3.yaml", *(a for x in sets for a in ("--set", x)), "--methods", "full",
            "--budgets", "12:4", "--no-progress", "--out", str(tmp_path / "cli"), "--traces", str(tmp_path / "nope")]
    assert cli_main(argv) == 2  # a missing traces folder: a one-line error
    wider = load_recipe("recipes/tiny-qwen3.yaml", [*sets, "sft.val_traces=1"])
    train_sft(wider, tmp_path / "tr", tmp_path / "sft1", progress=False, log=lambda *_: None)
    with pytest.raises(ValueError, match="trained on 1 of the 2 evaluation traces"):
        run_eval(v, tmp_path / "ev1", methods="full", budgets="12:4", scorers=[tmp_path / "sft1"], progress=False,
                 log=lambda *_: None)
    # by content: a copy of the folder elsewhere is the same traces
    shutil.copytree(tmp_path / "tr", tmp_path / "copy", symlinks=True)
    moved = load_recipe("recipes/tiny-qwen3.yaml", [*sets, f"eval.traces={tmp_path / 'copy'}"])
    with pytest.raises(ValueError, match="trained on 1 of the 2 evaluation traces"):
        run_eval(moved, tmp_path / "ev2", methods="full", budgets="12:4", scorers=[tmp_path / "sft1"], progress=False,
                 log=lambda *_: None)
    # a checkpoint from before fingerprints were recorded: checked by the folder's path
    shutil.copytree(tmp_path / "sft1", tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    assert len(cfg.pop("training_traces")["traces"]) == 7
    cfg["training_data"] = str(tmp_path / "tr")  # such checkpoints recorded the folder's absolute path
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="include its training traces"):
        run_eval(v, tmp_path / "ev3", methods="full", budgets="12:4", scorers=[tmp_path / "old"], progress=False,
                 log=lambda *_: None)
    # other samples of the scorer's training prompts are evaluated, and counted
    resampled = load_recipe("recipes/tiny-qwen3.yaml", [*sets, "traces.do_sample=true",
                                                        f"eval.traces={tmp_path / 'tr5'}"])
    traces.make_traces(resampled, tmp_path / "tr5", progress=False, log=lambda *_: None)
    notes = []
    run_eval(resampled, tmp_path / "ev5", methods="full", budgets="12:4", scorers=[tmp_path / "sft1"], progress=False,
             log=notes.append)
    meta = json.loads((tmp_path / "ev5" / "meta.json").read_text())
    assert meta["references_with_a_training_prompt"] == {str(tmp_path / "sft1"): 1}  # trace 6's prompt; 7 held out
    assert any("have a prompt the scorer" in n for n in notes)
    # more validation traces asked for than SFT's split holds out (a quarter of 8): the 2 it holds, said in the log
    capped = load_recipe("recipes/tiny-qwen3.yaml", [*sets, "sft.val_traces=4", f"eval.traces={tmp_path / 'tr'}"])
    notes = []
    run_eval(capped, tmp_path / "ev4", methods="full", budgets="12:4", progress=False, log=notes.append)
    assert json.loads((tmp_path / "ev4" / "meta.json").read_text())["num_problems"] == 2
    assert any("sft.val_traces=4" in n and "2 validation traces" in n and "a folder of 16 traces" in n for n in notes)
    notes.clear()
    run_eval(v, tmp_path / "ev6", methods="full", budgets="12:4", progress=False, log=notes.append)
    assert not any(n.startswith("[validation]") for n in notes)  # not capped: nothing said
    empty = load_recipe("recipes/tiny-qwen3.yaml", [*sets, "sft.val_traces=0", f"eval.traces={tmp_path / 'tr'}"])
    with pytest.raises(ValueError, match="no validation traces"):
        run_eval(empty, tmp_path / "ev0", methods="full", budgets="12:4", progress=False, log=lambda *_: None)


def test_eval_runs_the_part_before_the_first_eviction_once_per_batch_with_the_same_rows(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    """Every method of a budget holds the same cache until B + L: the evaluation runs that prefix once per batch and
    attention path (fused for query-free policies, probabilities for those reading statistics and for golden's
    recorded pass) and forks it for each method; the rows equal an evaluation that runs each method from token 0."""
    from foresight.evaluation import evaluate
    from foresight.evaluation.shared_prefixes import SharedPrefixes

    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "traces.max_new_tokens=48"])
    methods = "full,golden,streamingllm,h2o,tova,snapkv,knorm,random,random-keep-prompt"
    made = []

    class Spy(SharedPrefixes):
        def __init__(self, model):
            super().__init__(model)
            made.append(self)

    monkeypatch.setattr(evaluate, "SharedPrefixes", Spy)
    shared = run_eval(r, tmp_path / "shared", methods=methods, budgets="12:4,24:4", progress=False, log=lambda *_: None)
    (spy,) = made
    # per budget (one batch of 3 traces): the fused path's prefix (query-free and window-reading policies) and the
    # probabilities' (h2o, golden's pass recording every statistic for the recalls); at B=24 also random-keep-prompt's
    # two (its prompt protected: another schedule, another batching). Served from them: golden's pass along
    # StreamingLLM's sinks (they act at evictions only) and the other five heuristics, at both budgets
    assert (spy.built, spy.reused) == (2 + 4, 6 + 6)
    monkeypatch.setattr(SharedPrefixes, "get", lambda *a, **k: None)  # every method from token 0
    alone = run_eval(r, tmp_path / "alone", methods=methods, budgets="12:4,24:4", progress=False, log=lambda *_: None)
    assert shared == alone


def test_eval_keeps_the_recipe_s_whole_heads_for_every_method(tiny_model_dir, tmp_path):
    """cache.whole_heads reaches every method's cache: with every KV head whole nothing is lost at any budget."""
    from pathlib import Path

    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    heads = ",".join(f"{layer}:{h}" for layer in range(cfg["num_hidden_layers"]) for h in range(cfg["num_key_value_heads"]))
    sets = [f"model.path={tiny_model_dir}", *SETS, "eval.recall=false"]
    uniform = run_eval(load_recipe("recipes/tiny-qwen3.yaml", sets), tmp_path / "uniform", methods="full,golden,tova",
                       budgets="12:4", progress=False, log=lambda *_: None)
    whole = run_eval(load_recipe("recipes/tiny-qwen3.yaml", [*sets, f"cache.whole_heads={heads}"]), tmp_path / "whole",
                     methods="full,golden,tova", budgets="12:4", progress=False, log=lambda *_: None)
    for u, w in zip(uniform[1:], whole[1:]):
        assert u["loss_ratio"] > 1.001 and abs(w["loss_ratio"] - 1) < 1e-4, (u, w)
        assert w["mean_cache"] > u["mean_cache"]  # the whole heads' pairs count as held
