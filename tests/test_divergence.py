import torch

from foresight.evaluation.divergence import DivergenceStats, divergence_table, first_divergence


def test_first_divergence_finds_the_first_differing_new_token():
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == 1
    assert first_divergence([5, 6, 7], [4, 6, 7]) == 0
    assert first_divergence([5, 6, 7], [5, 6]) == 2  # stopped early: diverges where it ends
    assert first_divergence([5, 6], [5, 6, 8]) == 2


def test_stats_read_the_teacher_forced_loss_at_the_divergent_token():
    full_loss, entropy = torch.zeros(10), torch.linspace(0, 0.9, 10)
    loss = torch.zeros(10)
    loss[7] = 5.0  # prompt of 4 tokens: new token 3 is position 7
    loss[5] = 0.25
    st = DivergenceStats()
    st.add(0, 3, 4, loss, full_loss, entropy, correct=False)
    st.add(1, None, 4, loss, full_loss, entropy, correct=True)
    st.add(2, 9, 4, loss, full_loss, entropy, correct=False)  # past the reference's end: no loss there
    row = st.row()
    first = row["per_problem"][0]
    assert first["loss"] == 5.0 and first["loss_increase"] == 5.0 and first["loss_increase_before"] == 0.25
    assert abs(first["entropy"] - 0.7) < 1e-6
    assert "loss" not in row["per_problem"][2]
    assert row["diverged"] == round(2 / 3, 4) and row["position_median"] == 6  # median of 3 and 9
    assert row["loss_increase_median"] == 5.0
    table = divergence_table([{"method": "h2o", "budget": 8, "interval": 2, "divergence": row},
                              {"method": "golden", "budget": 8, "interval": 2, "divergence": None}])
    assert "| h2o | 8:2 | 0.67 | 6 | 5 |" in table and "golden" not in table


def test_eval_finds_where_the_teacher_s_greedy_text_breaks_and_the_loss_there(tmp_path):
    """The embedded teacher at a budget far below its prompt: generation under StreamingLLM leaves the reference at a
    look-up; up to there its cache is the teacher-forced rollout's, so the reference token's loss is ≥ ln 2."""
    import math

    from foresight.config.recipe import load_recipe
    from foresight.evaluation.evaluate import run_eval

    r = load_recipe("recipes/tiny-qwen3.yaml", ["task.facts=8", "task.variables=4", "task.scratch=0",
                                                "traces.max_new_tokens=48", "eval.num_problems=2",
                                                "eval.cache_references=false"])
    rows = run_eval(r, tmp_path / "ev", methods="full,streamingllm", budgets="32:8", progress=False, log=lambda *_: None)
    full, sllm = (x["divergence"] for x in rows)
    assert full["diverged"] == 0  # greedy generation with the whole cache writes the reference again
    assert sllm["diverged"] == 1.0
    for item in sllm["per_problem"]:
        assert item["loss"] >= math.log(2) - 1e-3 and item["loss_increase"] > 1.0
        assert item["loss_increase_before"] < item["loss_increase"]
