"""`foresight compare`: paired differences between two evaluated methods on the same held-out traces."""

import json
from pathlib import Path

import numpy as np
import pytest

from foresight.cli import main
from foresight.evaluation.compare import compare, compare_rows
from foresight.evaluation.paired import aligned, paired_diff_ci


def _row(method, budget, evicted, full, low, solved, order=None):
    n = len(full)
    order = list(range(n)) if order is None else order
    return {"method": method, "budget": budget, "interval": 8, "num_problems": n, "accuracy": float(np.mean(solved)),
            "per_problem_solved": list(solved),
            "per_trace": {"evicted_loss": [evicted[i] for i in order], "full_loss": [full[i] for i in order],
                          "trace": order, "low_entropy": [[low[i], 100] for i in order],
                          "high_entropy": [[2 * low[i], 25] for i in order]}}


def _pair(n=40, seed=0):
    """A base and a candidate on the same traces of very different difficulty; the candidate is 5% better on each."""
    rng = np.random.default_rng(seed)
    full = rng.uniform(50, 500, n).round(3).tolist()
    hard = rng.uniform(1.0, 3.0, n)
    low = (rng.uniform(0.1, 1.0, n) * 100).tolist()
    base_ev = (np.array(full) * hard * 1.05).tolist()
    cand_ev = (np.array(full) * hard).tolist()
    solved_base = (rng.uniform(size=n) < 0.5).astype(float)
    solved_cand = np.maximum(solved_base, (np.arange(n) % 4 == 0))  # solves every problem base does, and more
    return full, base_ev, cand_ev, low, solved_base, solved_cand


def test_paired_difference_separates_what_marginal_intervals_do_not():
    full, base_ev, cand_ev, low, sb, sc = _pair()
    base = _row("h2o", 64, base_ev, full, [1.1 * v for v in low], sb)
    cand = _row("foresight-sft", 64, cand_ev, full, low, sc, order=list(range(40))[::-1])  # another trace order
    m = compare_rows(base, cand)
    assert m["loss_ratio"]["verdict"] == "better" and m["loss_ratio"]["diff_ci"][1] < 0
    assert m["loss_ratio"]["base"] == pytest.approx(sum(base_ev) / sum(full), rel=1e-4)
    assert m["low_entropy_loss_increase"]["verdict"] == "better"
    assert m["accuracy"]["verdict"] == "better" and m["accuracy"]["diff"] > 0
    assert compare_rows(cand, base)["loss_ratio"]["verdict"] == "worse"  # the sign follows base/candidate
    same = compare_rows(base, base)
    assert all(v["verdict"] == "not separated" and v["diff_ci"] == [0.0, 0.0] for v in same.values())


def test_rows_of_other_traces_are_refused():
    full, base_ev, cand_ev, low, sb, sc = _pair()
    base = _row("h2o", 64, base_ev, full, low, sb)
    other = _row("foresight-sft", 64, cand_ev, [f + 1 for f in full], low, sc)  # same ids, other references
    with pytest.raises(ValueError, match="same held-out traces"):
        compare_rows(base, other)
    fewer = _row("foresight-sft", 64, cand_ev[:30], full[:30], low[:30], sc[:30])
    with pytest.raises(ValueError, match="same held-out traces"):
        compare_rows(base, fewer)


def test_paired_primitives():
    assert aligned([2, 0, 1], [0, 1, 2]) == [(1, 0), (2, 1), (0, 2)]
    assert aligned([0, 0, 1], [0, 1, 0]) is None and aligned([0, 1], [0, 2]) is None
    lo, hi = paired_diff_ci([1.0, 2.0, 3.0], None, [2.0, 3.0, 4.0], None)
    assert lo == hi == 1.0  # every item differs by exactly 1
    with pytest.raises(ValueError, match="aligned items"):
        paired_diff_ci([1.0, 2.0], None, [1.0], None)


def test_compare_command_between_two_evaluations(tmp_path, capsys):
    full, base_ev, cand_ev, low, sb, sc = _pair()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base = [_row("full", 64, full, full, [0.0] * 40, [1.0] * 40), _row("foresight-sft", 64, base_ev, full, low, sb),
            _row("foresight-sft", 128, base_ev, full, low, sb)]
    cand = [_row("foresight-grpo", 64, cand_ev, full, low, sc), _row("foresight-grpo", 256, cand_ev, full, low, sc)]
    (tmp_path / "a" / "results.json").write_text(json.dumps(base))
    (tmp_path / "b" / "results.json").write_text(json.dumps(cand))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "| 64:8 | loss ratio |" in out and "better" in out and "128:8" not in out  # only the shared budget
    result = json.loads((tmp_path / "c.json").read_text())
    assert result == compare(tmp_path / "a", tmp_path / "b")
    assert result["base"]["method"] == "foresight-sft" and result["candidate"]["method"] == "foresight-grpo"
    # clear errors: an ambiguous folder, a method it lacks, no shared budget, not an evaluation
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "results.json").write_text(json.dumps(base + cand))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "results.json").write_text(json.dumps(cand[1:]))
    for argv, msg in ((["compare", str(tmp_path / "c"), str(tmp_path / "b")], "say which with --base-method"),
                      (["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--method", "h2o"], "no rows of method 'h2o'"),
                      (["compare", str(tmp_path / "a"), str(tmp_path / "e")], "share no budget"),
                      (["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--base-method", "foresight-sft",
                        "--method", "foresight-sft"], "with itself"),
                      (["compare", str(tmp_path / "a"), str(tmp_path)], "no results.json")):
        assert main(argv) == 2, argv
        assert msg in capsys.readouterr().err
    # an evaluation on validation traces (`eval.traces`) numbers its traces from 0 too: never paired with held-out ones
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "results.json").write_text(json.dumps(cand))
    (tmp_path / "v" / "meta.json").write_text(json.dumps({"references": "validation traces of runs/tr"}))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "v")]) == 2
    assert "not the same traces" in capsys.readouterr().err
    (tmp_path / "a" / "meta.json").write_text(json.dumps({"references": "validation traces of runs/tr"}))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "v")]) == 0
    assert "on the same validation traces of runs/tr" in capsys.readouterr().out
    # the same folder named by an absolute path (newer evaluations store it resolved) is the same traces
    (tmp_path / "v" / "meta.json").write_text(json.dumps({"references": f"validation traces of {Path('runs/tr').resolve()}"}))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "v")]) == 0
    capsys.readouterr()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "results.json").write_text("{not json")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "d")]) == 2
    assert "not a results file" in capsys.readouterr().err


def test_results_table_tells_small_loss_increases_apart():
    """Two low-entropy increases of 0.00097 and 0.0023 (GRPO and SFT on the tiny teacher) print as different numbers;
    fixed 3 decimals printed both as 0.001/0.002 and their intervals as the same cells."""
    from foresight.evaluation.report import dloss, results_table

    def row(method, low, ci):
        return {"method": method, "protect_prompt": False, "budget": 320, "interval": 64, "loss_ratio": 2.0,
                "loss_ratio_ci": [1.5, 2.5], "low_entropy_loss_increase": low, "low_entropy_loss_increase_ci": ci,
                "high_entropy_loss_increase": 0.0928, "high_entropy_loss_increase_ci": [0.082, 0.105],
                "accuracy": 0.5, "n_samples": 1, "recall_at_L": None, "mean_cache": 338.4}

    meta = {"num_problems": 256, "mean_trace_length": 1368.0, "mean_prompt_length": 167.0,
            "full_cache_trace_accuracy": 0.98}
    md = results_table([row("a", 0.00097, [0.0005, 0.00158]), row("b", 0.0023, [0.00152, 0.00314]),
                        row("c", -3e-9, [-1e-8, 0.0])], meta)
    assert "| 0.00097 [0.0005, 0.00158] |" in md and "| 0.0023 [0.00152, 0.00314] |" in md
    assert "| 0.0928 [0.082, 0.105] |" in md
    assert "| <1e-5 [<1e-5, <1e-5] |" in md  # below results.json's 5-decimal rounding: no spurious digits
    assert dloss(None) == "—" and dloss(0.957) == "0.957" and dloss(-2e-05) == "-0.00002"
