"""A user's mistake ends with one line, ``foresight: error: ...`` and exit status 2, that names the problem (and the
file, where there is one), never a traceback."""

import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foresight import cli

from foresight.data import traces
from foresight.config.recipe import load_recipe

RECIPE = "recipes/tiny-qwen3.yaml"


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def one_line_error(code, err, *needles):
    """Exit status 2, no traceback, one ``foresight: error:`` line (progress bars aside) holding every needle."""
    assert code == 2, err
    errors = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("foresight: error: ")]
    assert "Traceback" not in err and len(errors) == 1, err
    for n in needles:
        assert str(n) in errors[0], (n, errors[0])


@pytest.mark.parametrize("override, needle", [
    ("sft.steps=nan", "sft.steps: expected an integer, got 'nan'"),
    ("sft.steps=inf", "sft.steps: expected an integer, got 'inf'"),
    ("sft.lr=.inf", "sft.lr: expected a finite number"),
    ('sft.steps="[1"', "sft.steps: expected an integer"),
    ("sft.steps=[1", "not valid YAML"),
    ("cache.interval=0", "interval"),
])
def test_bad_overrides(capsys, tmp_path, override, needle):
    one_line_error(*run(capsys, "traces", "--recipe", RECIPE, "--set", override, "--out", tmp_path / "o"), needle)


def test_a_single_budget_reads_as_the_budget_it_looks_like(tmp_path):
    """YAML 1.1 reads ``256:32`` as the base-60 integer 15392; a recipe or ``--set`` means the budget."""
    assert load_recipe(RECIPE, ["eval.budgets=256:32"]).eval.budgets == "256:32"
    f = tmp_path / "r.yaml"
    f.write_text("cache:\n  budget: 64\n  interval: 16\neval:\n  budgets: 128:32\n  num_problems: 0x10\n")
    r = load_recipe(f, ["sft.lr=3e-4", "sft.steps=1_000"])
    assert (r.eval.budgets, r.eval.num_problems, r.sft.lr, r.sft.steps) == ("128:32", 16, 3e-4, 1000)


def test_a_recipe_that_is_a_folder(capsys, tmp_path):
    one_line_error(*run(capsys, "traces", "--recipe", tmp_path, "--out", tmp_path / "o"), f"recipe {tmp_path} is not a file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys, tmp_path):
    one_line_error(*run(capsys, "traces", "--recipe", RECIPE, "--set", "model.device=cuda", "--out", tmp_path / "o"),
                   "cuda")


def test_out_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("keep me")
    one_line_error(*run(capsys, "traces", "--recipe", RECIPE, "--out", f), f)
    assert f.read_text() == "keep me"


def _model_copy(tiny_model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    return d


def test_a_corrupt_weights_file(capsys, tiny_model_dir, tmp_path):
    d = _model_copy(tiny_model_dir, tmp_path)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    one_line_error(*run(capsys, "traces", "--recipe", RECIPE, "--set", f"model.path={d}", "--out", tmp_path / "o"),
                   f"cannot load model {str(d)!r}")


def test_weights_that_do_not_match_their_config(capsys, tiny_model_dir, tmp_path):
    d = _model_copy(tiny_model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] *= 2
    (d / "config.json").write_text(json.dumps(cfg))
    one_line_error(*run(capsys, "traces", "--recipe", RECIPE, "--set", f"model.path={d}", "--out", tmp_path / "o"),
                   f"cannot load model {str(d)!r}")


@pytest.fixture
def small_traces(tiny_model_dir, tmp_path):
    sets = [f"model.path={tiny_model_dir}", "task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0",
            "traces.num_prompts=4", "traces.batch_size=2", "traces.require_correct=false", "traces.min_new_tokens=5",
            "traces.max_new_tokens=12"]
    out = tmp_path / "tr"
    traces.make_traces(load_recipe(RECIPE, sets), out, progress=False, log=lambda *_: None)
    return out, sets


def test_an_empty_part_file_is_named(capsys, small_traces):
    out, sets = small_traces
    part = sorted((out / "parts").glob("*.json"))[0]
    part.write_text("")
    shutil.rmtree(out / "dataset", ignore_errors=True)
    (out / "dataset").unlink(missing_ok=True)
    args = ["traces", "--recipe", RECIPE, "--out", out, "--no-progress"] + [x for s in sets for x in ("--set", s)]
    one_line_error(*run(capsys, *args), f"part file {part} is not valid JSON")


def test_garbage_in_the_arrow_file_is_named(capsys, small_traces, tmp_path):
    out, sets = small_traces
    arrow = next((out / "dataset").resolve().glob("*.arrow"))
    arrow.write_bytes(b"\x00garbage" * 50)
    args = ["sft", "--recipe", RECIPE, "--traces", out, "--out", tmp_path / "sft", "--no-progress"]
    one_line_error(*run(capsys, *args, *[x for s in sets[:1] for x in ("--set", s)]), "is not a traces dataset")


def test_foreign_token_ids_are_refused_before_training(capsys, small_traces, tmp_path):
    import datasets

    out, sets = small_traces
    rows = [dict(r) for r in datasets.load_from_disk(str(out / "dataset"))]
    for r in rows:
        r["input_ids"] = r["input_ids"][:-1] + [10**6]
    bad = datasets.Dataset.from_list(rows)
    shutil.rmtree((out / "dataset").resolve())
    (out / "dataset").unlink(missing_ok=True)
    bad.save_to_disk(str(out / "dataset"))
    args = ["sft", "--recipe", RECIPE, "--traces", out, "--out", tmp_path / "sft", "--no-progress"]
    one_line_error(*run(capsys, *args, "--set", sets[0]), "vocabulary")


def test_a_broken_scorer_config_is_named(capsys, tmp_path):
    d = tmp_path / "scorer"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    args = ["eval", "--recipe", RECIPE, "--scorers", d, "--out", tmp_path / "ev", "--no-progress"]
    one_line_error(*run(capsys, *args), f"{d / 'config.json'} is not valid JSON")


def test_a_broken_deepspeed_config_is_named(capsys, small_traces, tmp_path):
    out, sets = small_traces
    bad = tmp_path / "ds.json"
    bad.write_text("{")
    args = ["sft", "--recipe", RECIPE, "--traces", out, "--out", tmp_path / "sft", "--deepspeed", bad, "--no-progress",
            "--set", sets[0], "--set", "sft.steps=1"]
    one_line_error(*run(capsys, *args), f"DeepSpeed config {bad}")


def _unprivileged():
    """A command prefix that runs as the user ``nobody`` (root ignores file permissions), or None."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return None
    exe = shutil.which("setpriv")
    return None if exe is None else [exe, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["traces", "eval"])
def test_a_read_only_out_folder_fails_before_any_work(tmp_path, stage):
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("cannot drop to an unprivileged user here")
    home = tmp_path / "home"
    home.mkdir()
    ro = tmp_path / "read-only"
    ro.mkdir()
    for p in (tmp_path, home):
        p.chmod(0o777)
    ro.chmod(0o555)
    env = dict(os.environ, HOME=str(home), HF_HOME=str(home / "hf"), FORESIGHT_CACHE=str(home / "cache"),
               MPLCONFIGDIR=str(home / "mpl"))
    args = [stage, "--recipe", RECIPE, "--out", str(ro / "run"), "--no-progress"]
    if stage == "eval":
        args += ["--methods", "full,h2o", "--budgets", "320:64"]
    res = subprocess.run(prefix + [sys.executable, "-m", "foresight", *args], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    errors = [x for x in res.stderr.splitlines() if x.startswith("foresight: error")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-2000:]
    assert "cannot write" in errors[0] and str(ro / "run") in errors[0], errors
    assert "Traceback" not in res.stderr and not any(ro.iterdir())
