import json
import os

import pytest
import torch

from foresight.data import traces
from foresight.config.recipe import load_recipe
from foresight.engine.models import load_model
from foresight.engine.rollout import loss_and_entropy
from foresight.data.trace_data import TraceDataError, load_traces


def recipe_for(model_dir, **extra):
    sets = [f"model.path={model_dir}", "task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0",
            "traces.num_prompts=6", "traces.batch_size=2", "traces.require_correct=false",
            "traces.min_new_tokens=5", "traces.max_new_tokens=12", "traces.loss_chunk=7"]
    sets += [f"{k}={v}" for k, v in extra.items()]
    return load_recipe("recipes/tiny-qwen3.yaml", sets)


def test_traces_run_writes_dataset_with_loss_and_entropy(tiny_model_dir, tmp_path):
    r = recipe_for(tiny_model_dir)
    out = tmp_path / "tr"
    summary = traces.make_traces(r, out, progress=False, log=lambda *_: None)
    ds = load_traces(out)
    assert summary["num_traces"] == len(ds) == 6
    for col in ("input_ids", "prompt_len", "answer", "correct", "token_loss", "token_entropy"):
        assert col in ds.column_names
    meta = json.loads((out / "meta.json").read_text())
    assert meta["seed"] == 0 and meta["num_traces"] == 6 and "date" in meta
    # stored loss and entropy equal a direct full-sequence computation
    model, _ = load_model(r.model, device="cpu")
    row = ds[0]
    ids = torch.tensor([row["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    nll, ent = loss_and_entropy(logits[:, :-1], ids[:, 1:])
    assert torch.allclose(torch.tensor(row["token_loss"][1:]), nll[0], atol=1e-4)
    assert torch.allclose(torch.tensor(row["token_entropy"][1:]), ent[0], atol=1e-4)
    assert row["token_loss"][0] == 0.0


def test_more_prompts_extend_the_data_without_skipping_any(tiny_model_dir, tmp_path):
    """Reproduction: num_prompts=3 then 4 with batches of 2 skipped prompt 3 (the short last batch counted as done)."""
    out = tmp_path / "tr"
    traces.make_traces(recipe_for(tiny_model_dir, **{"traces.num_prompts": 3}), out, progress=False,
                       log=lambda *_: None)
    meta = json.loads((out / "meta.json").read_text())
    traces.make_traces(recipe_for(tiny_model_dir, **{"traces.num_prompts": 4}), out, progress=False,
                       log=lambda *_: None)
    assert load_traces(out)["prompt_index"] == [0, 1, 2, 3]
    again = json.loads((out / "meta.json").read_text())
    assert again["num_traces"] == 4 and meta["throughput"]["traces_per_minute"] > 0
    written = {f: f.stat().st_mtime_ns for f in out.rglob("*") if f.is_file()}
    summary = traces.make_traces(recipe_for(tiny_model_dir, **{"traces.num_prompts": 4}), out, progress=False,
                                 log=lambda *_: None)  # finished: a rerun keeps the folder, its measured throughput too
    assert summary["kept_this_run"] == 0 and summary["num_traces"] == 4
    assert {f: f.stat().st_mtime_ns for f in out.rglob("*") if f.is_file()} == written
    assert json.loads((out / "meta.json").read_text()) == again


def test_traces_resume_after_interruption(tiny_model_dir, tmp_path):
    r = recipe_for(tiny_model_dir)
    out = tmp_path / "tr"
    traces.make_traces(r, out, progress=False, log=lambda *_: None)
    first = load_traces(out)
    # simulate a kill after the first batch: drop later part files and the merged dataset
    for f in sorted((out / "parts").glob("prompts-*.json"))[1:]:
        f.unlink()
    import shutil

    (out / "dataset").unlink()
    for d in out.glob("dataset.v*"):
        shutil.rmtree(d)
    first_part = out / "parts" / "prompts-0000000-0000002.json"
    before = first_part.stat().st_mtime_ns
    logs = []
    traces.make_traces(r, out, progress=False, log=logs.append)
    assert any("resuming" in x for x in logs)
    assert first_part.stat().st_mtime_ns == before  # not regenerated
    again = load_traces(out)
    assert again["prompt_index"] == first["prompt_index"] == list(range(6))  # nothing duplicated
    assert again["input_ids"] == first["input_ids"]


def test_traces_refuses_other_recipes_folder(tiny_model_dir, tmp_path):
    out = tmp_path / "tr"
    traces.make_traces(recipe_for(tiny_model_dir), out, progress=False, log=lambda *_: None)
    with pytest.raises(TraceDataError, match="another recipe.*task.facts"):
        traces.make_traces(recipe_for(tiny_model_dir, **{"task.facts": 5}), out, progress=False)


def test_traces_clear_errors(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        traces.make_traces(recipe_for(tmp_path / "nope"), tmp_path / "a", progress=False)
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    r = recipe_for(tiny_model_dir, **{"task.kind": "math", "traces.prompt_dataset": str(bad)})
    with pytest.raises(ValueError, match="no column 'prompt'.*question"):
        traces.make_traces(r, tmp_path / "b", progress=False)


def test_math_prompts_from_local_dataset(tiny_model_dir, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(3)))
    r = recipe_for(tiny_model_dir, **{"task.kind": "math", "traces.prompt_dataset": str(f), "traces.num_prompts": 3})
    out = tmp_path / "m"
    traces.make_traces(r, out, progress=False, log=lambda *_: None)
    ds = load_traces(out)
    assert len(ds) == 3 and ds["correct"] == [False, False, False]  # a random model cannot box the sum


@pytest.mark.slow
def test_two_processes_split_prompts_and_merge(tiny_model_dir, tmp_path):
    """torchrun with 2 CPU processes (gloo): disjoint part files, one merged dataset equal to one process's."""
    import subprocess
    import sys

    sets = ["--set", f"model.path={tiny_model_dir}", "--set", "task.facts=4", "--set", "task.variables=2",
            "--set", "task.filler=0", "--set", "task.scratch=0", "--set", "traces.num_prompts=6",
            "--set", "traces.batch_size=2", "--set", "traces.require_correct=false",
            "--set", "traces.min_new_tokens=5", "--set", "traces.max_new_tokens=12", "--set", "traces.loss_chunk=7"]
    out2 = tmp_path / "two"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           "-m", "foresight", "traces", "--recipe", "recipes/tiny-qwen3.yaml", "--out", str(out2), "--no-progress", *sets]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    two = load_traces(out2)
    one_dir = tmp_path / "one"
    traces.make_traces(recipe_for(tiny_model_dir), one_dir, progress=False, log=lambda *_: None)
    one = load_traces(one_dir)
    assert two["prompt_index"] == one["prompt_index"] == list(range(6))
    assert two["input_ids"] == one["input_ids"]
    assert torch.allclose(torch.tensor(sum(two["token_loss"], [])), torch.tensor(sum(one["token_loss"], [])), atol=1e-5)
