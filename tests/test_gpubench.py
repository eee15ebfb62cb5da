"""`make bench-gpu` stays runnable: the whole CLI on CPU at the tiny shape (every row in a child process of its own),
its report, and its refusals (an unknown shape, CUDA asked for where there is none, lengths that never evict)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpubench.__main__ import main, run
from benchmarks.gpubench.rows import CUDA_ONLY, ROWS
from benchmarks.gpubench.configs import BenchSettings, shape_config
from benchmarks.gpubench.timing import DECODE_CASES

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--device", "cpu", "--shape", "tiny", "--lengths", "96,128", "--batches", "1,2", "--new-tokens", "4",
         "--repeat", "1", "--memory-prompt", "96", "--launch-chunks", "2"]
POSITIVE = {"rollout": ("dense_s", "rollout_s", "ratio"), "group": ("dense_s", "rollout_s", "ratio"),
            "golden": ("dense_s", "golden_s", "ratio"), "decode": ("prefill_s", "ms_per_token", "tokens_per_s"),
            "memory": ("largest_transient", "bound"), "launches": ("per_chunk_layer", "plain_per_chunk_layer", "ratio")}


@pytest.mark.slow
def test_cpu_smoke_run_writes_every_row(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpubench", *SMALL, "--out", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "gpubench.json").read_text())
    assert report["settings"]["shape"] == "tiny" and report["settings"]["lengths"] == [96, 128]
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["transformers"]
    assert report["device"]["weights_bytes"] > 0
    entries = report["rows"]
    assert {e["row"] for e in entries} == set(ROWS)
    assert set(report["row_seconds"]) == set(ROWS) and report["elapsed_s"] > 0
    for e in entries:
        if "skipped" in e:
            assert e["skipped"] == "cuda only" and e["row"] in CUDA_ONLY, e
            continue
        assert "error" not in e and not e.get("oom"), e
        for key in POSITIVE[e["row"]]:
            assert e[key] > 0, (key, e)
    cases = {(e["row"], e["case"]) for e in entries}
    assert {("rollout", f"{p} S={S} batch=1") for p, S in [("h2o", 96), ("h2o", 128), ("streamingllm", 96),
                                                            ("learned", 96)]} <= cases
    assert {("group", "learned sample S=96 batch=8"), ("group", "learned sample graph S=96 batch=8"),
            ("rollout", "h2o graph S=128 batch=1"), ("rollout", "learned graph S=96 batch=1")} <= cases
    assert {("decode", f"{p}{' graph' if step == 'graph' else ''} batch={b} prompt=96")
            for p, step in DECODE_CASES for b in (1, 2)} <= cases
    assert all(e["vs_full"] > 0 for e in entries if e["row"] == "decode")
    md = (tmp_path / "gpubench.md").read_text().splitlines()
    rows = [line for line in md if line.startswith("| ") and not line.startswith("| row |")]
    assert [line.split(" | ")[0][2:] for line in rows] == [e["row"] for e in entries]
    assert res.stdout.rstrip().endswith(md[-1])  # the table is printed at the end


def test_a_spent_time_budget_skips_rows_without_running_them(tmp_path):
    s = BenchSettings.defaults("cpu")
    report = run(s, ["rollout", "fit"], tmp_path, time_budget=-1)
    assert [(e["row"], e["skipped"]) for e in report["rows"]] == [("rollout", "time budget"), ("fit", "cuda only")]
    assert "| rollout | (row) | time budget |" in (tmp_path / "gpubench.md").read_text()


@pytest.mark.parametrize("args, problem", [
    (["--device", "cpu", "--shape", "qwen3-99b"], "unknown shape 'qwen3-99b'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--device", "cpu", "--lengths", "64"], "length 64 must exceed B + L = 80"),
    (["--device", "cpu", "--rows", "rollout,speed"], "unknown row(s) speed"),
    (["--device", "cuda"], "--device cuda was requested but CUDA is not available"),
])
def test_bad_requests_fail_with_a_message_naming_the_problem(args, problem, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err


def test_the_qwen3_4b_shape():
    cfg = shape_config("qwen3-4b")  # the config only: no model is built
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads) == (36, 8, 128, 32)
    assert shape_config("qwen3-8b").tie_word_embeddings is False
