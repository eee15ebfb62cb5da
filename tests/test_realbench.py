"""The real-model benchmark: its prompts (distinct, splits disjoint by construction, the shipped file reproducible),
the split guard, the goal checks, and the whole pipeline end to end on a tiny model (resumable, report written)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from data_prep import realbench as rb_prompts
from foresight.config.recipe import load_recipe
from foresight.evaluation import evaluate
from foresight.training import sft

ROOT = Path(__file__).resolve().parents[1]


def test_prompts_are_distinct_and_the_splits_share_nothing():
    rows = rb_prompts.make_prompts(264, 384, more=1056)
    texts = [r["prompt"] for r in rows]
    assert len(set(texts)) == len(texts) == 1704
    # training rows, the held-out block, then the second training block
    assert [r["split"] for r in rows] == ["train"] * 264 + ["heldout"] * 384 + ["train"] * 1056
    assert {r["kind"] for r in rows[:264]} == {r["kind"] for r in rows[264:648]} == {r["kind"] for r in rows[648:]}
    assert rows[:648] == rb_prompts.make_prompts(264, 384)  # the second block moves nothing before it
    train = " ".join(t for t, r in zip(texts, rows) if r["split"] == "train")
    held = " ".join(t for t, r in zip(texts, rows) if r["split"] == "heldout")
    more = " ".join(texts[648:])
    for pool in (rb_prompts.NAMES, rb_prompts.ITEMS, rb_prompts.SUBJECTS, rb_prompts.ESSAYS, rb_prompts.MORE_NAMES,
                 rb_prompts.MORE_ITEMS, rb_prompts.MORE_SUBJECTS, rb_prompts.MORE_ESSAYS):
        assert not [w for w in pool if f" {w}" in train and f" {w}" in held]  # no name or topic in both splits
    for pool in (rb_prompts.MORE_NAMES, rb_prompts.MORE_SUBJECTS, rb_prompts.MORE_ESSAYS):
        assert [w for w in pool if f" {w}" in more]  # the second block uses its own pools
    for r in rows:
        if r["kind"] == "math":  # the stated answer follows from the numbers
            each, kept = map(int, r["answer"].split(", "))
            assert each >= 0 and kept >= 0
    shipped = (ROOT / "data_prep/prompts/realbench.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in shipped] == rows  # the shipped file is this generator's output


def test_more_heldout_rows_keep_the_earlier_ones():
    """Growing the held-out split (64 -> 192 -> 384 rows) appends prompts: the training rows and the first held-out rows
    stay as they were, so cached reference traces and earlier reports (their first 48 or 192 held-out rows) remain
    valid."""
    small, mid, large = (rb_prompts.make_prompts(264, n) for n in (64, 192, 384))
    assert mid[:328] == small and large[:456] == mid
    assert rb_prompts.make_prompts(10, 5)[:10] == rb_prompts.make_prompts(10, 50)[:10]


def test_a_recipe_reading_heldout_rows_as_training_rows_is_refused():
    from foresight.data import prompts

    recipe = load_recipe(ROOT / "recipes/smollm2-135m-realbench.yaml", ["traces.num_prompts=300"])
    with pytest.raises(ValueError, match=r"row 264 is a 'heldout' prompt, read as 'train'"):
        prompts.load_prompts(recipe.task, recipe.traces, 256, 16, split="train")
    with pytest.raises(ValueError, match="row 263 is a 'train' prompt"):
        prompts.load_prompts(recipe.task, recipe.traces, 263, 4, split="heldout")
    assert len(prompts.load_prompts(recipe.task, recipe.traces, 264, 64, split="heldout")) == 64
    with pytest.raises(ValueError, match="row 648 is a 'train' prompt"):  # more held-out rows than the file has
        prompts.heldout_prompts(recipe.task, recipe.traces, 385)


def test_training_prompts_past_the_first_block_skip_the_heldout_rows():
    from foresight.data import prompts

    traces_cfg = load_recipe(ROOT / "recipes/smollm2-135m-realbench.yaml").traces
    assert prompts.training_rows(traces_cfg, 0, 264) == list(range(264))
    assert prompts.training_rows(traces_cfg, 256, 16) == list(range(256, 264)) + list(range(648, 656))
    with pytest.raises(ValueError, match="has 1320 training rows; traces.num_prompts asks for 1321"):
        prompts.training_rows(traces_cfg, 1300, 21)
    task = load_recipe(ROOT / "recipes/smollm2-135m-realbench.yaml").task
    read = prompts.load_rows(task, traces_cfg, prompts.training_rows(traces_cfg, 262, 4), split="train")
    assert [p.index for p in read] == [262, 263, 648, 649]


def test_heldout_rows_do_not_move_with_the_number_of_training_prompts(tmp_path):
    """Traces from part of the training rows are evaluated on the dataset's held-out rows; a dataset without a
    ``split`` column holds out the rows after the training prompts."""
    from foresight.data import prompts

    R = ROOT / "recipes/smollm2-135m-realbench.yaml"
    r, r64 = load_recipe(R), load_recipe(R, ["traces.num_prompts=64"])
    every = [p.index for p in prompts.heldout_prompts(r.task, r.traces, 3)]
    assert every == [p.index for p in prompts.heldout_prompts(r64.task, r64.traces, 3)] == [264, 265, 266]
    plain = tmp_path / "p.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(10)))
    r = load_recipe(R, [f"traces.prompt_dataset={plain}", "traces.num_prompts=7"])
    assert [p.index for p in prompts.heldout_prompts(r.task, r.traces, 5)] == [7, 8, 9]


def _row(method, B, lr, ci, low=0.1, low_ci=(0.09, 0.11)):
    return {"method": method, "budget": B, "interval": 32, "loss_ratio": lr, "loss_ratio_ci": list(ci),
            "low_entropy_loss_increase": low, "low_entropy_loss_increase_ci": list(low_ci), "recall_at_L": 0.8,
            "recall_at_L_ci": [0.78, 0.82]}


def test_goal_checks_compare_intervals_and_twice_the_budget():
    from studies.realbench.goals import goal_checks, grpo_vs_sft

    rows = [_row("foresight-sft", 128, 1.10, (1.08, 1.12), 0.2, (0.18, 0.22)),
            _row("foresight-grpo", 128, 1.12, (1.09, 1.15), 0.1, (0.09, 0.11)),
            _row("h2o", 128, 1.20, (1.15, 1.25)), _row("tova", 128, 1.14, (1.11, 1.18)),
            _row("h2o", 256, 1.05, (1.03, 1.07)), _row("tova", 256, 1.11, (1.09, 1.13)),
            _row("foresight-sft", 256, 1.02, (1.01, 1.025)), _row("golden", 256, 1.0, (1.0, 1.0))]
    c128, c256 = goal_checks(rows)
    assert c128["best_learned"] == "foresight-sft" and c128["best_heuristic"] == "tova"
    assert c128["below_every_heuristic"] and not c128["separated_from_every_heuristic"]
    assert c128["heuristics_not_separated"] == ["tova"]  # 1.12 > 1.11: the intervals overlap
    assert c128["best_heuristic_at_2B"] == "h2o" and c128["at_or_below_best_heuristic_at_2B"] is False  # 1.10 > 1.05
    assert c256["separated_from_every_heuristic"] and c256["at_or_below_best_heuristic_at_2B"] is None
    # a heuristic that holds more pairs (the prompt on top of B) is set apart from the equal-memory comparison
    rows += [_row("random-keep-prompt", 128, 1.09, (1.07, 1.11)) | {"mean_cache": 230.0}]
    for r in rows:
        r.setdefault("mean_cache", 150.0)
    c128 = goal_checks(rows)[0]
    assert c128["heuristics_holding_more"] == ["random-keep-prompt"] and not c128["below_every_heuristic"]
    assert not c128["separated_at_equal_memory"]  # tova still overlaps
    rows = [r for r in rows if r["method"] != "tova"]
    c128 = goal_checks(rows)[0]
    assert c128["separated_at_equal_memory"] and not c128["separated_from_every_heuristic"]
    (g,) = grpo_vs_sft(rows)
    assert g["budget"] == 128 and g["grpo_below_with_separated_intervals"]


def test_paired_difference_separates_what_trace_difficulty_hides():
    """Two methods on the same 40 traces of very different difficulty: each one's own interval is wide and they
    overlap, but the learned one is lower on every trace, which the paired interval of the difference shows; the
    traces are matched by their full-cache loss whatever order the rows list them in."""
    from studies.realbench.goals import goal_checks
    from foresight.evaluation.report import bootstrap_ci, paired_ratio_diff_ci

    rng = np.random.default_rng(0)
    full = rng.uniform(50, 500, 40).round(3)
    hard = rng.uniform(1.0, 2.0, 40)
    heur = {"evicted_loss": (full * hard * 1.05).tolist(), "full_loss": full.tolist()}
    mine = {"evicted_loss": (full * hard)[::-1].tolist(), "full_loss": full[::-1].tolist()}  # another order
    ci_mine = bootstrap_ci(mine["evicted_loss"], mine["full_loss"])
    ci_heur = bootstrap_ci(heur["evicted_loss"], heur["full_loss"])
    assert ci_mine[1] > ci_heur[0]  # the marginal intervals overlap
    lo, hi = paired_ratio_diff_ci(mine, heur)
    assert lo < hi < 0
    assert paired_ratio_diff_ci(heur, heur) == [0.0, 0.0]
    assert paired_ratio_diff_ci(mine, {"evicted_loss": [1.0], "full_loss": [2.0]}) is None  # not the same traces
    ratio = lambda pt: sum(pt["evicted_loss"]) / sum(pt["full_loss"])  # noqa: E731
    rows = [_row("foresight-sft", 128, ratio(mine), ci_mine) | {"per_trace": mine},
            _row("scissorhands", 128, ratio(heur), ci_heur) | {"per_trace": heur}]
    (c,) = goal_checks(rows)
    assert not c["separated_from_every_heuristic"] and c["heuristics_not_below_paired"] == []


def test_ablation_and_sampler_tables_pair_each_row_with_the_main_one():
    """Each SFT variant's loss ratio minus the main scorer's, and each sampler's minus the main sampler's for the same
    scorer, with the paired interval on the same traces; the reference method is golden only when recall is measured."""
    from studies.realbench import run as realbench
    from studies.realbench.report import ablation_table, sampler_table

    full = [10.0, 20.0, 30.0, 40.0]

    def row(method, evicted):
        r = _row(method, 256, sum(evicted) / sum(full), (0.9, 1.3))
        return r | {"per_trace": {"evicted_loss": evicted, "full_loss": full, "trace": [0, 1, 2, 3]}}

    main = row("foresight-sft", [11.0, 21.0, 33.0, 42.0])
    worse = row("foresight-sft(kv-only)", [12.0, 23.0, 34.0, 45.0])  # above main on every trace
    table = ablation_table([row("golden", full), main, worse], {"foresight-sft": "main"})
    lines = table.splitlines()
    assert "− main (paired 95% CI)" in lines[0] and len(lines) == 4  # golden is not a learned row
    assert lines[2].split(" | ")[2] == "—"  # the main row against itself
    diff, lo, hi = (float(x.strip("[],")) for x in lines[3].split(" | ")[2].split())
    assert diff == pytest.approx(7 / 100) and 0 < lo <= diff <= hi
    sampled = row("foresight-sft", worse["per_trace"]["evicted_loss"])  # the main scorer, sampling its evictions
    md = sampler_table({"topk": [main], "sample": [sampled, row("foresight-grpo", full)], "multinomial": None}, "topk")
    assert "− topk (paired 95% CI)" in md[0] and len(md) == 5
    assert md[2].split(" | ")[3] == "—" and md[3].split(" | ")[3].startswith("+0.0700 [")  # the top-L row pairs
    assert md[4].split(" | ")[3] == "—"  # no top-L row of GRPO to pair with
    assert realbench.reference_method(load_recipe(ROOT / "recipes/smollm2-135m-realbench.yaml")) == "golden"
    off = load_recipe(ROOT / "recipes/smollm2-135m-realbench.yaml", ["eval.recall=false"])
    assert realbench.reference_method(off) == "full"


@pytest.mark.slow
def test_realbench_runs_end_to_end_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """Every stage on a tiny model and short traces; a second run trains and evaluates nothing again."""
    from studies.realbench import run as realbench

    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache"))
    sets = (f"model.path={tiny_model_dir}", "task.facts=4", "task.variables=2", "task.scratch=0",
            "traces.num_prompts=6", "traces.batch_size=6", "traces.require_correct=false", "traces.min_new_tokens=5",
            "traces.max_new_tokens=40", "traces.min_tokens=30", "cache.budget=12", "cache.interval=4",
            "sft.steps=2", "sft.batch_traces=2", "sft.ckpt_every=1", "sft.example_steps=2", "kvpop.window=4",
            "kvpop.sinks=1", "grpo.steps=2", "grpo.traces_per_step=1", "grpo.group=2", "grpo.epochs=1",
            "grpo.ckpt_every=1", "eval.num_problems=2", "eval.budgets=8:4,16:4",
            "eval.methods=full,golden,h2o,streamingllm")
    # first the SFT scorer alone and its evaluation (a report from part of the run), then everything: the evaluation
    # is extended by the later scorers' rows, the SFT rows kept as they were
    first = realbench.Bench(ROOT / "recipes/tiny-qwen3.yaml", sets, tmp_path / "rb", tmp_path / "report",
                            ("traces", "sft", "eval", "report"))
    realbench.run(first)
    early = json.loads((tmp_path / "report/results.json").read_text())["main"]
    assert {r["method"] for r in early} == {"full", "golden", "h2o", "streamingllm", "foresight-sft"}
    bench = realbench.Bench(ROOT / "recipes/tiny-qwen3.yaml", sets, tmp_path / "rb", tmp_path / "report")
    realbench.run(bench)
    res = json.loads((tmp_path / "report/results.json").read_text())
    methods = {r["method"] for r in res["main"]}
    assert methods == {"full", "golden", "h2o", "streamingllm", "foresight-sft", "foresight-grpo", "kvpop-mlp"}
    assert {r["budget"] for r in res["main"]} == {8, 16}
    assert all(r["loss_ratio_ci"] for r in res["main"] if r["method"] != "full")
    abl = {r["method"] for r in res["ablations"]}
    assert abl == {"golden", "foresight-sft"} | {f"foresight-sft({n})" for n, _, _ in realbench.SFT_ABLATIONS}
    assert {r["budget"] for r in res["ablations"]} == {16}  # the middle budget
    assert all(r in res["main"] for r in early)  # the SFT evaluation's rows, unchanged
    for mode in realbench.SAMPLERS:  # top-L is the main evaluation's own selection: its rows, not a second run
        assert {"golden", "foresight-sft", "foresight-grpo"} <= {r["method"] for r in res["samplers"][mode]}
    assert not (tmp_path / "rb" / "eval-sampler-topk").exists()
    assert len(res["grpo"]["history"]) == 2 and {"kl", "clip_frac", "reward_mean"} <= set(res["grpo"]["history"][0])
    md = (tmp_path / "report/results.md").read_text()
    assert "## Goal checks" in md and "attn-only" in md and "| multinomial |" in md and "− main (paired 95% CI)" in md
    assert "- **Machine:** " in md and f"{os.cpu_count()} cores" in md  # where it was measured, with command and commit
    width = load_recipe(ROOT / "recipes/tiny-qwen3.yaml").scorer.hidden  # the tiny recipe's scorer, from its config
    assert f"main: key + value + attention, width {width}, mean pooling" in md
    pred = res["predictability"]
    assert pred["identity"]["probe"]["problems"] == 2 and set(pred["summary"]["scorer"]) == {"8:4", "16:4"}
    assert "How much of golden's choice the past decides" in md and 0 <= pred["summary"]["golden"]["8:4"]["ceiling"] <= 1
    assert "| the scorer's own trajectory | 16:4 | 2 |" in md
    assert (tmp_path / "report/grpo.png").exists() and (tmp_path / "report/overview.png").exists()
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "rb").glob("**/config.json")}
    assert len(stamps) == 3 + len(realbench.SFT_ABLATIONS)

    def nothing_computed(*_):
        raise AssertionError("a finished bench computed again")

    monkeypatch.setattr(sft, "rows_loss", nothing_computed)
    monkeypatch.setattr(evaluate, "evaluate_row", nothing_computed)
    realbench.run(bench)  # everything is done: nothing is trained or evaluated again
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_paired_difference_matches_traces_that_share_a_full_cache_loss():
    """Two held-out traces with the same full-cache loss (to 4 digits) cannot be told apart by it: with the trace
    ids an evaluation now records they pair exactly, whatever the order; without ids, the same list in the same order
    pairs by position; otherwise no interval rather than a wrong one."""
    from foresight.evaluation.report import paired_ratio_diff_ci

    full = [10.0, 10.0, 20.0, 30.0]
    a = {"evicted_loss": [11.0, 15.0, 21.0, 33.0], "full_loss": full, "trace": [0, 1, 2, 3]}
    b = {"evicted_loss": [34.0, 22.0, 16.0, 12.0], "full_loss": full[::-1], "trace": [3, 2, 1, 0]}  # b = a + 1 each
    no_ids = [{k: v for k, v in x.items() if k != "trace"} for x in (a, b)]
    same_order = {"evicted_loss": [12.0, 16.0, 22.0, 34.0], "full_loss": full}  # b in a's order, without ids
    lo, hi = paired_ratio_diff_ci(b, a)
    assert 0 < lo <= 4 / 70 <= hi and [lo, hi] == paired_ratio_diff_ci(same_order, no_ids[0])
    assert paired_ratio_diff_ci(no_ids[1], no_ids[0]) is None  # 10.0 twice, in another order: ambiguous
    wrong = {"evicted_loss": [12.0, 15.0, 22.0, 34.0], "full_loss": full}  # trace 1 unchanged: not b
    assert paired_ratio_diff_ci(wrong, no_ids[0]) != [lo, hi]


def test_a_report_of_an_evaluation_alone_says_it_has_no_training_traces(tmp_path):
    """The report stage on a folder that holds only an evaluation (given scorers, more held-out references): goal
    checks from its rows, and no made-up training-trace figures."""
    from foresight.runtime import atomic
    from studies.realbench.run import SAMPLERS, SFT_ABLATIONS
    from studies.realbench.report import write_report

    extra = {"protect_prompt": False, "high_entropy_loss_increase": 0.2, "accuracy": None, "n_samples": 0,
             "mean_cache": 150.0, "keep_recall": None}
    rows = [_row("foresight-sft", 128, 1.10, (1.08, 1.12)) | extra, _row("tova", 128, 1.20, (1.15, 1.25)) | extra]
    atomic.write_json(tmp_path / "ev" / "eval" / "results.json", rows)
    atomic.write_json(tmp_path / "ev" / "eval" / "meta.json", {"model": "m", "num_problems": 192,
                                                                "mean_trace_length": 1125.0, "mean_prompt_length": 101.0,
                                                                "full_cache_trace_accuracy": None})
    res = write_report(tmp_path / "ev", tmp_path / "rep", SFT_ABLATIONS, SAMPLERS, command="c", took={})
    md = (tmp_path / "rep" / "results.md").read_text()
    assert "none in this folder" in md and "? kept" not in md and "**held-out:** 192 references" in md
    assert res["goal_checks"][0]["separated_from_every_heuristic"] is True
    assert "| 128:32 | foresight-sft | 1.1000 | tova | 1.2000 | yes | yes |" in md
