import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foresight.runtime.locks import LOCK, OutputBusyError, output_lock
from foresight.data.trace_data import load_traces

HOLD = """
import sys, time
from foresight.runtime.locks import output_lock
with output_lock(sys.argv[1], "sft"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_second_run_into_a_held_folder_is_refused_naming_the_holder(tmp_path):
    d = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(d), "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(OutputBusyError, match=f"in use by `foresight sft` \\(pid {p.pid}"):
            with output_lock(d, "sft"):
                pass
    finally:
        p.kill()
        p.wait()
    with output_lock(d, "sft"):  # the killed holder's lock is stale: taken over
        assert json.loads((d / LOCK).read_text())["pid"] == os.getpid()
    assert not (d / LOCK).exists()


def test_a_failed_run_leaves_no_empty_folder_and_keeps_existing_ones(tmp_path):
    with pytest.raises(RuntimeError):
        with output_lock(tmp_path / "new", "eval"):
            raise RuntimeError("failed before writing anything")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    with pytest.raises(RuntimeError):
        with output_lock(tmp_path / "old", "eval"):
            raise RuntimeError
    assert (tmp_path / "old").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        with output_lock(tmp_path / "file", "eval"):
            pass


@pytest.mark.slow
def test_two_concurrent_traces_runs_into_one_folder(tiny_model_dir, tmp_path):
    """Reproduction: two identical `foresight traces` started together into one folder. One runs, the other is
    refused at once with a clear message; the folder ends with a complete dataset."""
    out = tmp_path / "tr"
    sets = [f"model.path={tiny_model_dir}", "task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0",
            "traces.num_prompts=8", "traces.batch_size=2", "traces.require_correct=false", "traces.min_new_tokens=5",
            "traces.max_new_tokens=64"]
    cmd = [sys.executable, "-m", "foresight", "traces", "--recipe", "recipes/tiny-qwen3.yaml", "--out", str(out),
           "--no-progress"] + [x for s in sets for x in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "foresight: error" in refused and "in use by `foresight traces`" in refused
    assert len(load_traces(out)) == 8 and not (out / LOCK).exists()


def test_an_evaluation_holds_its_folder_for_the_whole_run(tmp_path, monkeypatch):
    """The evaluation holds its output folder while it runs, like every stage (the lock once guarded only the read of
    the finished rows and was gone before the model loaded, so a second evaluation could run into the folder)."""
    from foresight.evaluation import evaluate
    from foresight.config.recipe import load_recipe

    d = tmp_path / "ev"

    class Loaded(Exception):
        pass

    def load_model(cfg, device=None):  # foresight.engine.models.load_model's parameters
        holder = json.loads((d / LOCK).read_text())
        assert holder["pid"] == os.getpid() and holder["stage"] == "eval"
        raise Loaded

    monkeypatch.setattr(evaluate, "load_model", load_model)
    with pytest.raises(Loaded):
        evaluate.run_eval(load_recipe("recipes/tiny-qwen3.yaml"), d, methods="h2o", budgets="12:4", progress=False,
                          log=lambda *_: None)
    assert not (d / LOCK).exists()


def test_the_lock_appears_with_its_holder_written(tmp_path, monkeypatch):
    """The lock file is linked into place already holding its holder (no window where another run reads it empty and
    can only say "another foresight run"); a second creation fails and leaves it intact; no temporary file stays.
    Where hard links are refused, exclusive creation and a write still take it."""
    from foresight.runtime.locks import _create, _holder

    lock = tmp_path / LOCK
    seen = []
    real_link = os.link
    monkeypatch.setattr(os, "link", lambda a, b: (real_link(a, b), seen.append(_holder(Path(b))))[0])
    assert _create(lock, {"pid": 1, "stage": "sft"}) and seen == [{"pid": 1, "stage": "sft"}]
    assert not _create(lock, {"pid": 2, "stage": "eval"}) and _holder(lock) == {"pid": 1, "stage": "sft"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]
    lock.unlink()
    monkeypatch.setattr(os, "link", lambda a, b: (_ for _ in ()).throw(PermissionError("no hard links here")))
    assert _create(lock, {"pid": 3, "stage": "grpo"}) and _holder(lock) == {"pid": 3, "stage": "grpo"}
    assert not _create(lock, {"pid": 4, "stage": "eval"}) and sorted(p.name for p in tmp_path.iterdir()) == [LOCK]
