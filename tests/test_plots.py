"""The evaluation's figures and summary: one distinct style per method, log axes where values span decades, the
summary names the best learned scorer, heuristic and golden at each budget."""

import json

import pytest

from foresight.evaluation import plots, report, styles

SCORERS = ["foresight-sft", "foresight-grpo", "kvpop-mlp", "kvpop-mlstm-delayed", "kvpop-mlstm-immediate"]


def eval_methods() -> list[str]:
    """Every name `foresight eval` can give a row: its fixed methods, the policy registry and the scorer stages."""
    import foresight.policies  # noqa: F401  (fills the registry)
    from foresight.policies.base import REGISTRY

    return sorted({"full", "golden", "kvpop-oracle", "random-keep-prompt", *REGISTRY, *SCORERS})


def _key(style: dict):
    return (style["color"], style["marker"], str(style["linestyle"]))


def test_every_eval_method_has_its_own_style():
    names = eval_methods()
    assert {"h2o", "rkv", "snapkv", "scissorhands", "streamingllm"} <= set(names)
    keys = {n: _key(styles.method_style(n)) for n in names}
    assert len(set(keys.values())) == len(names), keys
    assert len({styles.method_style(n)["color"] for n in names if styles.method_group(n) != "reference"}) == \
        len([n for n in names if styles.method_group(n) != "reference"])  # colours alone tell the curves apart
    for n in SCORERS:
        assert styles.method_group(n) == "learned"
        assert styles.method_style(n)["linewidth"] > max(styles.method_style(h)["linewidth"] for h in styles.HEURISTIC)
    for n in ("full", "golden", "kvpop-oracle"):
        assert styles.method_group(n) == "reference"


def test_unknown_and_suffixed_names_get_deterministic_distinct_styles():
    known = {_key(styles.method_style(n)) for n in eval_methods()}
    mine = styles.method_style("my-policy")
    assert _key(mine) not in known and _key(mine) != _key(styles.method_style("your-policy"))  # distinct
    assert styles.method_style("my-policy") is not mine and styles.method_style("my-policy") == mine  # a fresh equal copy
    assert styles.method_group("my-policy") == "heuristic" and styles.method_group("foresight-rl") == "learned"
    twin = styles.method_style("foresight-sft(run2)")
    assert twin["color"] == styles.method_style("foresight-sft")["color"] and _key(twin) not in known
    assert twin == styles.method_style("foresight-sft(run2)") and _key(twin) != _key(styles.method_style("foresight-sft(run3)"))


def fake_rows(budgets=((320, 64), (640, 128), (960, 128)), methods=None) -> list[dict]:
    """Rows shaped like results.json: the full cache at ~1e-4 nats per token, so the loss ratios run to 1e4."""
    methods = methods or ["full", "golden", "random", "random-keep-prompt", "streamingllm", "h2o", "tova", "snapkv",
                          "rkv", "scissorhands", "knorm", "keydiff", "foresight-sft", "foresight-grpo"]
    rows = []
    for bi, (B, L) in enumerate(budgets):
        for mi, m in enumerate(methods):
            if m == "full":
                inc, acc = 0.0, 0.94
            elif m == "golden":
                inc, acc = 0.002 / (bi + 1), None
            elif m.startswith("foresight"):
                inc = (0.05 if m.endswith("sft") else 0.03) / (bi + 1) ** 2
                acc = [0.0, 0.81, 0.9][bi] + (0.03 if m == "foresight-grpo" and bi else 0.0)
            else:
                inc, acc = (1.5 + 0.1 * mi) / (bi + 1), [0.0, 0.3 + 0.02 * mi, 0.6 + 0.02 * mi][bi]
            ci = [inc * 0.8, inc * 1.2] if m != "full" else [0.0, 0.0]
            rows.append({"method": m, "budget": B, "interval": L, "protect_prompt": m == "random-keep-prompt",
                         "loss_ratio": round(1 + inc / 1e-4, 3), "loss_ratio_ci": [1 + ci[0] / 1e-4, 1 + ci[1] / 1e-4],
                         "low_entropy_loss_increase": inc, "low_entropy_loss_increase_ci": ci,
                         "high_entropy_loss_increase": 2 * inc, "high_entropy_loss_increase_ci": [2 * c for c in ci],
                         "accuracy": acc, "n_samples": 0 if acc is None else 1, "recall_at_L": None,
                         "mean_cache": B, "num_problems": 16, "per_trace": {}})
    return rows


META = {"recipe": "tiny-qwen3", "model": "builtin:tiny-qwen3", "num_problems": 16, "full_cache_trace_accuracy": 0.94,
        "mean_trace_length": 1368.0, "mean_prompt_length": 167.0, "seconds": 1.0}


def test_values_spanning_decades_get_a_log_axis_and_accuracy_stays_linear():
    assert styles.choose_scale([1.0, 50.0]) == "linear" and styles.choose_scale([1.0, 90000.0]) == "log"
    assert styles.choose_scale([0.0, -1.0, 0.001, 0.5]) == "log"  # non-positive values do not count
    rows = fake_rows()
    fig = plots.metric_figure(rows, ["loss_ratio", "low_entropy_loss_increase", "accuracy"], META)
    ratio, inc, acc = fig.axes
    assert ratio.get_yscale() == "log" and inc.get_yscale() == "log" and acc.get_yscale() == "linear"
    narrow = [r | {"low_entropy_loss_increase": 0.5 + 0.01 * i} for i, r in enumerate(rows)]
    assert plots.metric_figure(narrow, ["low_entropy_loss_increase"], META).axes[0].get_yscale() == "linear"
    text = fig._suptitle.get_text()
    assert "builtin:tiny-qwen3" in text and "16 held-out traces" in text and "640:128 (47%)" in text
    # the legend sits outside the axes, right of the last one
    leg = fig.legends[0]
    fig.canvas.draw()
    assert leg.get_window_extent().x0 >= acc.get_window_extent().x1
    labels = [t.get_text() for t in leg.get_texts()]
    assert labels.index("foresight-grpo") < labels.index("golden") < labels.index("h2o")


def test_negative_loss_increase_is_drawn_at_the_floor_of_a_log_axis():
    rows = fake_rows()
    rows[1] = rows[1] | {"low_entropy_loss_increase": -1e-5, "low_entropy_loss_increase_ci": [-2e-5, 1e-5]}
    ax = plots.metric_figure(rows, ["low_entropy_loss_increase"], META).axes[0]
    assert ax.get_yscale() == "log" and "drawn at the floor" in ax.get_ylabel()


def test_the_full_cache_line_stays_in_view_when_every_loss_ratio_is_far_above_it(recwarn):
    rows = [r | {"loss_ratio": 1.0 if r["method"] == "full" else 900.0 + r["budget"]}
            for r in fake_rows(budgets=((32, 8),), methods=["full", "streamingllm"])]
    fig = plots.metric_figure(rows, ["loss_ratio"], META)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] < 1.0 < ax.get_ylim()[1]  # the line at 1 is drawn
    fig.canvas.draw()
    assert not [w for w in recwarn if "layout not applied" in str(w.message)]  # the title has its room


def test_budget_curves_writes_the_figures_and_reads_meta(tmp_path):
    rows = fake_rows()
    (tmp_path / "meta.json").write_text(json.dumps(META))
    plots.budget_curves(rows, tmp_path)
    for f in ("accuracy.png", "loss_ratio.png", "loss_increase.png", "overview.png"):
        assert (tmp_path / f).stat().st_size > 10_000, f


def test_summary_names_the_best_learned_heuristic_and_golden_per_budget():
    rows = fake_rows()
    lines = report.summary_lines(rows, META)
    per_budget = [x for x in lines if x.lstrip().startswith("B=")]
    assert len(per_budget) == 3
    assert "full cache accuracy 0.94" in lines[0]
    b640 = next(x for x in per_budget if x.lstrip().startswith("B=640:128 (47%)"))
    assert "best learned foresight-grpo (accuracy 0.84" in b640
    assert "best heuristic keydiff (accuracy 0.52" in b640  # the highest heuristic accuracy in fake_rows
    assert "golden Δloss 0.001" in b640
    # all at 0 accuracy: the lowest loss increase decides
    b320 = per_budget[0]
    assert "best learned foresight-grpo (accuracy 0.00, Δloss 0.03)" in b320
    assert "best heuristic random (accuracy 0.00" in b320
    bare = report.summary_lines([r for r in rows if r["method"] in ("full", "h2o")], META)[2]
    assert "best learned — |" in bare and "best heuristic h2o" in bare and "golden Δloss —" in bare


@pytest.mark.parametrize("args", [["--headline", "docs/x.png"], []])
def test_command_line(tmp_path, args, capsys):
    res = tmp_path / "ev"
    res.mkdir()
    (res / "results.json").write_text(json.dumps(fake_rows()))
    (res / "meta.json").write_text(json.dumps(META))
    argv = ["--results", str(res)] + [str(tmp_path / a) if a.endswith(".png") else a for a in args]
    assert plots.main(argv) == 0
    if args:
        assert (tmp_path / "docs" / "x.png").exists() and "best learned" in (tmp_path / "docs" / "x.txt").read_text()
        assert not (res / "overview.png").exists()
    else:
        assert (res / "overview.png").exists()
    assert "best heuristic" in capsys.readouterr().out
