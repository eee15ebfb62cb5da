import json
import math

import pytest
import torch

from foresight.config.recipe import load_recipe
from foresight.data import traces
from foresight.evaluation.evaluate import run_eval
from foresight.training.sft import train_sft

SETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=6",
        "traces.batch_size=3", "traces.require_correct=false", "traces.min_new_tokens=5", "traces.max_new_tokens=24",
        "cache.budget=12", "cache.interval=4", "sft.steps=2", "sft.batch_traces=2", "eval.num_problems=3"]


def test_eval_writes_results_tables_and_plots_reproducibly(tiny_model_dir, tmp_path):
    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS])
    traces.make_traces(r, tmp_path / "tr", progress=False, log=lambda *_: None)
    train_sft(r, tmp_path / "tr", tmp_path / "sft", progress=False, log=lambda *_: None)
    methods = "full,golden,random,streamingllm,h2o,tova,snapkv,rkv,scissorhands,knorm,keydiff,random-keep-prompt"
    card_before = (tmp_path / "sft" / "README.md").read_text()
    rows = run_eval(r, tmp_path / "ev", methods=methods, budgets="12:4,24:4", scorers=[tmp_path / "sft"],
                    progress=False, log=lambda *_: None)
    assert (tmp_path / "sft" / "README.md").read_text() == card_before  # inputs are not modified unless asked
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
        for part in ("low_entropy", "high_entropy"):  # the per-trace sums behind the row (for paired comparisons)
            sums = x["per_trace"][part]
            n = sum(c for _, c in sums)  # 0 when no trace runs past the first eviction (a protected prompt at B=24)
            assert len(sums) == 3 and (n > 0 or x["method"] == "random-keep-prompt")
            assert sum(v for v, _ in sums) / max(n, 1) == pytest.approx(x[f"{part}_loss_increase"], abs=2e-5)
        if x["accuracy"] is not None:
            assert len(x["per_problem_solved"]) == 3 and sum(x["per_problem_solved"]) / 3 == pytest.approx(x["accuracy"])
        if x["accuracy"] is not None:  # greedy: where generation left the reference, and the loss there
            d = x["divergence"]
            assert len(d["per_problem"]) == 3 and 0 <= d["diverged"] <= 1
            if x["method"] == "full":
                assert d["diverged"] == 0  # without eviction greedy generation writes the reference again
            for item in d["per_problem"]:
                if "loss" in item:  # the same cache as the teacher-forced rollout up to there: the reference token
                    assert item["loss"] >= math.log(2) - 1e-3  # lost its argmax, so its probability is below 1/2
    assert "First divergence" in (tmp_path / "ev" / "results.md").read_text()
    # `foresight compare` on two rows of this evaluation: the full cache against StreamingLLM, paired on the traces
    from foresight.cli import main as cli_main

    assert cli_main(["compare", str(tmp_path / "ev"), str(tmp_path / "ev"), "--base-method", "full", "--method",
                     "streamingllm", "--json", str(tmp_path / "cmp.json")]) == 0
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert [(c["budget"], c["interval"]) for c in cmp["rows"]] == [(12, 4), (24, 4)]
    for c in cmp["rows"]:
        lr = c["metrics"]["loss_ratio"]
        st = next(x for x in rows if x["method"] == "streamingllm" and x["budget"] == c["budget"])
        assert lr["base"] == pytest.approx(1.0) and lr["candidate"] == pytest.approx(st["loss_ratio"], rel=1e-4)
        assert set(c["metrics"]) == {"loss_ratio", "low_entropy_loss_increase", "high_entropy_loss_increase", "accuracy"}
    rkp = next(x for x in rows if x["method"] == "random-keep-prompt")
    assert rkp["protect_prompt"] is True and rkp["budget"] == 24
    for f in ("results.json", "results.md", "accuracy.png", "loss_ratio.png", "eviction_map.png"):
        assert (tmp_path / "ev" / f).exists(), f
    again = run_eval(r, tmp_path / "ev2", methods="golden,random,h2o", budgets="12:4,24:4", scorers=[tmp_path / "sft"],
                     progress=False, log=lambda *_: None, record=True)
    assert again == [x for x in rows if x["method"] in ("golden", "random", "h2o", "foresight-sft")]
    assert json.loads((tmp_path / "ev" / "results.json").read_text()) == rows
    card = (tmp_path / "sft" / "README.md").read_text()
    assert "## Evaluation" in card and "12:4" in card  # the model card carries the scorer's eval rows
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["eval"][0]["method"] == "foresight-sft"
    # a killed evaluation resumes from its finished rows (here: all but the last 5) and ends with the same rows
    (tmp_path / "ev" / "results.json").write_text(json.dumps(rows[:-5]))
    from foresight.evaluation import evaluate

    calls = []
    real = evaluate.teacher_forced
    evaluate.teacher_forced = lambda *a, **k: calls.append(a[0].name) or real(*a, **k)
    try:
        resumed = run_eval(r, tmp_path / "ev", methods=methods, budgets="12:4,24:4", scorers=[tmp_path / "sft"],
                           progress=False, log=lambda *_: None)
    finally:
        evaluate.teacher_forced = real
    assert resumed == rows and set(calls) == {x["method"] for x in rows[-5:]}
    with pytest.raises(ValueError, match="holds another evaluation"):
        run_eval(r, tmp_path / "ev", methods="h2o", budgets="12:4", progress=False, log=lambda *_: None)
    # an evaluation that extends a finished one (a method more) computes only the new method's rows
    calls.clear()
    evaluate.teacher_forced = lambda *a, **k: calls.append(a[0].name) or real(*a, **k)
    try:
        more = run_eval(r, tmp_path / "ev2", methods="golden,random,h2o,tova", budgets="12:4,24:4",
                        scorers=[tmp_path / "sft"], progress=False, log=lambda *_: None)
    finally:
        evaluate.teacher_forced = real
    assert set(calls) == {"tova"}
    assert [x for x in more if x["method"] != "tova"] == again
    assert [x for x in more if x["method"] == "tova"] == [x for x in rows if x["method"] == "tova"]


def test_an_evaluation_extends_another_only_by_adding():
    from foresight.evaluation.resume import extends

    old = {"recipe": {"a": 1}, "methods": ["h2o", "tova"], "budgets": [[12, 4]], "scorers": [["sft", "t1"]]}
    assert extends(old, old)
    assert extends(old, old | {"methods": ["golden", "tova", "h2o"], "budgets": [[24, 4], [12, 4]],
                               "scorers": [["sft", "t1"], ["grpo", "t2"]]})
    assert not extends(old, old | {"methods": ["h2o"]})  # a method dropped
    assert not extends(old, old | {"budgets": [[24, 4]]})  # a budget dropped
    assert not extends(old, old | {"scorers": [["grpo", "t2"], ["sft", "t1"]]})  # the scorers' names would change
    assert not extends(old, old | {"scorers": [["sft", "t0"]]})  # the same folder retrained
    assert not extends(old, old | {"recipe": {"a": 2}})
    assert not extends(old, old | {"recipe": {"a": 1, "b": 0}})  # a field the old run did not record
    # a run written when the identity held the whole recipe extends by what shapes the rows, as long as it agrees
    assert extends(old | {"recipe": {"a": 1, "grpo": {"lr": 1e-3}}}, old)


def test_training_settings_are_not_part_of_an_evaluation_s_identity():
    """A GRPO or scorer setting changed after an evaluation (or a field added to them) does not make its folder
    "another evaluation": the scorers are checkpoints; the references' sampling and the cache's settings do."""
    from foresight.evaluation.resume import eval_identity

    base = eval_identity(load_recipe("recipes/tiny-qwen3.yaml"))
    assert "grpo" not in base and "scorer" not in base and base["sft"] == {"golden_pool": "mean"}
    assert eval_identity(load_recipe("recipes/tiny-qwen3.yaml", ["grpo.lr=0.1", "sft.steps=7", "scorer.hidden=64"])) == base
    for changed in ("traces.temperature=0.3", "cache.sinks=2", "sft.golden_pool=max", "kvpop.window=8"):
        assert eval_identity(load_recipe("recipes/tiny-qwen3.yaml", [changed])) != base, changed
    assert "traces" not in base["eval"]  # held-out evaluations keep the identity they had before eval.traces
    on_val = eval_identity(load_recipe("recipes/tiny-qwen3.yaml", ["eval.traces=runs/tr"]))
    assert on_val["eval"]["traces"] == "runs/tr" and on_val["sft"]["val_traces"] == 2
    assert eval_identity(load_recipe("recipes/tiny-qwen3.yaml", ["eval.traces=runs/tr", "sft.val_traces=4"])) != on_val


def _refs(model, lengths, prompt_len=6):
    from foresight.engine.rollout import rollout

    refs = []
    g = torch.Generator().manual_seed(3)
    for S in lengths:
        ids = torch.randint(8, 170, (1, S), generator=g)
        full = rollout(model, ids)
        refs.append({"ids": ids, "prompt_len": prompt_len, "loss": full.token_loss[0], "entropy": full.token_entropy[0],
                     "correct": None})
    return refs


def test_batched_unequal_traces_equal_one_by_one(qwen3):
    """Right-padded batches of traces of different lengths give every trace the per-token losses, pairs held and
    golden recall it gets alone (fp32, 1e-5)."""
    from foresight.data.references import make_batch, stack_padded, trace_batches
    from foresight.evaluation.evaluate import teacher_forced
    from foresight.evaluation.labels import golden_pass
    from foresight.evaluation.methods import build_methods
    from foresight.targets.golden import block_pooled_attention

    refs = _refs(qwen3, [70, 83, 64, 91, 77])
    assert trace_batches(refs, 3, False) == [[2, 0, 4], [1, 3]]  # by length, at most 3, spread <= 1.25
    for m in build_methods(["golden", "h2o", "tova", "snapkv", "streamingllm", "random-keep-prompt"], [], qwen3,
                           False):
        settings = m.settings(24, 8, "evict")
        fut = {i: block_pooled_attention(qwen3, r["ids"], settings).future() for i, r in enumerate(refs)}
        batch = make_batch(refs, [0, 1, 2, 3, 4], 0)
        F = stack_padded([fut[i] for i in range(5)], (1, 3))
        loss, held = teacher_forced(m, qwen3, batch, settings, 0, F)
        recall = golden_pass([m], qwen3, batch, settings, F, 0).recalls[m.name]
        for i, r in enumerate(refs):
            one = make_batch(refs, [i], 0)
            l1, h1 = teacher_forced(m, qwen3, one, settings, 0, fut[i][None])
            S = r["ids"].shape[1]
            if m.name != "random-keep-prompt":  # random draws depend on the batch
                assert torch.allclose(loss[i, :S], l1[0], atol=1e-5), (m.name, i)
                assert torch.allclose(held[i, :S], h1[0, :S], atol=1e-4), (m.name, i)
            assert (loss[i, S:] == 0).all()
            alone = golden_pass([m], qwen3, one, settings, fut[i][None], 0).recalls[m.name]
            assert {row for row, *_ in alone} <= {0}
            if m.name != "random-keep-prompt":  # each trace's recalls, batched or alone
                assert [(round(v, 5), round(kv, 5)) for row, v, kv in recall if row == i] == \
                    [(round(v, 5), round(kv, 5)) for _, v, kv in alone], (m.name, i)


def test_one_golden_rollout_scores_every_method_as_its_own_would(qwen3):
    """The recall pass is shared by the methods of a budget: each gets what a golden rollout of its own gives (the
    random policy included: every method draws from its own generator)."""
    from foresight.data.references import make_batch, trace_batches
    from foresight.evaluation.labels import golden_pass
    from foresight.evaluation.methods import build_methods
    from foresight.targets.golden import block_pooled_attention

    refs = _refs(qwen3, [70, 83, 64])
    meths = build_methods(["golden", "h2o", "tova", "knorm", "random"], [], qwen3, False)
    settings = meths[1].settings(24, 8, "evict")
    assert all(m.settings(24, 8, "evict") == settings for m in meths)
    batch = make_batch(refs, trace_batches(refs, 3, False)[0], 0)
    F = block_pooled_attention(qwen3, batch["ids"], settings, lengths=batch["lengths"])
    from foresight.data.references import stack_padded

    F = stack_padded(F.futures(), (1, 3))
    shared = golden_pass(meths, qwen3, batch, settings, F, 5).recalls
    assert shared["golden"] == []  # golden is its own reference
    for m in meths[1:]:
        own = golden_pass([m], qwen3, batch, settings, F, 5).recalls[m.name]
        assert own and shared[m.name] == own, m.name
    assert shared["h2o"] != shared["random"]
    for m in meths[1:]:  # keep recall: golden's kept candidates kept too; 1 exactly when the L evictions agree
        assert all(0 <= kv <= 1 and (kv == 1) == (v == 1) and kv >= v for _, v, kv in shared[m.name]), m.name


def test_references_are_seeded_per_prompt_batched_and_cached(tiny_model_dir, monkeypatch, capsys):
    from foresight.data import prompts, references
    from foresight.engine.models import load_model

    sets = [f"model.path={tiny_model_dir}", *SETS[:4], "traces.max_new_tokens=12", "eval.do_sample=true",
            "traces.temperature=1.0", "traces.top_k=0", "traces.top_p=1.0"]
    r = load_recipe("recipes/tiny-qwen3.yaml", sets + ["traces.batch_size=3"])
    model, tok = load_model(r.model)
    problems = prompts.load_prompts(r.task, r.traces, r.traces.heldout_offset, 3, tok)
    capsys.readouterr()
    batched = references.reference_traces(r, model, tok, problems, "cpu", use_cache=False, log=lambda *_: None,
                                          progress=True)
    err = capsys.readouterr().err
    assert "references: 100%" in err and "3/3" in err  # a bar over the three generated references
    r1 = load_recipe("recipes/tiny-qwen3.yaml", sets + ["traces.batch_size=1"])
    alone = references.reference_traces(r1, model, tok, problems, "cpu", use_cache=True, log=lambda *_: None)
    for a, b in zip(batched, alone):  # a sampled row does not depend on the batch it ran in
        assert torch.equal(a["ids"], b["ids"]) and torch.allclose(a["loss"], b["loss"], atol=1e-5)
    assert len({tuple(x["ids"][0].tolist()) for x in alone}) == 3
    monkeypatch.setattr(references, "generate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("generated")))
    again = references.reference_traces(r, model, tok, problems, "cpu", use_cache=True, log=lambda *_: None,
                                        progress=True)
    assert "references" not in capsys.readouterr().err  # nothing to generate, no bar
    assert all(torch.equal(a["ids"], b["ids"]) and torch.equal(a["loss"], b["loss"]) for a, b in zip(again, alone))
    other = load_recipe("recipes/tiny-qwen3.yaml", sets + ["traces.max_new_tokens=13"])
    with pytest.raises(AssertionError, match="generated"):  # another trace length is another reference
        references.reference_traces(other, model, tok, problems, "cpu", use_cache=True, log=lambda *_: None)


