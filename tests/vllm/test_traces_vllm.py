"""``traces.engine: openai`` against a real ``vllm serve`` (vLLM's CPU build) of SmolLM2 exported in float32: the
prompts go as token ids, the traces come back token for token as the in-process engine makes them, and a killed
client or server loses nothing."""

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from foresight.data import traces
from foresight.data.openai_client import ServerError
from foresight.data.trace_data import load_traces
from tests.vllm.conftest import BATCHED_TOKENS, QUIET, RECIPE, smollm2, vllm_server

GREEDY = ["traces.do_sample=false", "traces.num_prompts=8", "traces.batch_size=8", "traces.concurrency=8",
          "traces.min_tokens=256", "traces.min_new_tokens=256", "traces.max_new_tokens=288"]


def served(url: str, *sets: str) -> list[str]:
    return ["traces.engine=openai", f"traces.base_url={url}", *sets]


def test_greedy_traces_through_vllm_equal_in_process_ones_token_for_token(server, exported, tmp_path):
    here = traces.make_traces(smollm2(*GREEDY), tmp_path / "hf", **QUIET)
    there = traces.make_traces(smollm2(*GREEDY, *served(server.url)), tmp_path / "vllm", **QUIET)
    a, b = load_traces(tmp_path / "hf"), load_traces(tmp_path / "vllm")
    assert here["num_traces"] == there["num_traces"] == 8 and min(b["num_new_tokens"]) >= 256
    for i, (x, y) in enumerate(zip(a["input_ids"], b["input_ids"])):
        first = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), None)
        assert x == y, f"prompt {i}: first differing token at {first} (prompt length {a['prompt_len'][i]})"
    assert a["token_loss"] == b["token_loss"] and a["token_entropy"] == b["token_entropy"]  # the same local pass
    engine = json.loads((tmp_path / "vllm" / "meta.json").read_text())["engine"]
    # the served model was found by the folder vLLM loaded (foresight-export.json), and sent token ids
    assert engine["server_model"] == str(exported) and engine["request_style"] == "openai"
    assert there["max_in_flight"] == 8


QUESTIONS = ["What is 2 + 2?", "Name the capital of France.", "What colour is the sky?", "What is 10 times 3?",
             "Say hello.", "How many legs does a cat have?", "What is the opposite of hot?", "Spell the word cat."]


def sampled(url: str, n: int, seed: int, *sets: str) -> list[str]:
    return served(url, "traces.do_sample=true", f"traces.num_prompts={n}", f"traces.batch_size={n}",
                  f"traces.concurrency={n}", "traces.min_new_tokens=0", f"traces.seed={seed}", *sets)


def test_sampled_traces_are_reproducible_from_run_to_run(server, tmp_path):
    sets = ["traces.min_tokens=0", "traces.max_new_tokens=48"]
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        traces.make_traces(smollm2(*sampled(server.url, 24, seed, *sets)), tmp_path / name, **QUIET)
        runs[name] = load_traces(tmp_path / name)
    assert runs["a"]["input_ids"] == runs["b"]["input_ids"]  # per-prompt seeds: the same traces from run to run
    assert runs["a"]["input_ids"] != runs["c"]["input_ids"]  # and another seed samples others
    # the 24 prompts arrived at once with more tokens than the server's step holds: the server had to schedule them
    # over several steps (which, with chunked prefill on, splits a seeded prompt and fails on vLLM's CPU build)
    assert sum(runs["a"]["prompt_len"]) > BATCHED_TOKENS


def test_min_and_max_tokens_are_honoured(server, tmp_path):
    """Short questions, which SmolLM2 answers in a few tokens unless ``min_tokens`` holds EOS back."""
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    runs = {}
    for name, min_tokens in (("held", 32), ("free", 0)):
        sets = [f"traces.prompt_dataset={prompts}", f"traces.min_tokens={min_tokens}", "traces.max_new_tokens=64"]
        traces.make_traces(smollm2(*sampled(server.url, 8, 0, *sets)), tmp_path / name, **QUIET)
        runs[name] = load_traces(tmp_path / name)
    assert all(32 <= n <= 64 for n in runs["held"]["num_new_tokens"])
    assert min(runs["free"]["num_new_tokens"]) < 32  # without min_tokens the answers stop earlier
    stopped = [json.loads(p.read_text()) for p in sorted((tmp_path / "free" / "completions").glob("prompt-*.json"))]
    assert stopped and all(c["new_tokens"][-1] == 2 for c in stopped if c["finish_reason"] == "stop")  # EOS kept


def wait_for(folder, n: int, alive) -> None:
    while len(list(folder.glob("prompt-*.json"))) < n and alive():
        time.sleep(0.05)


SMALL = ["traces.num_prompts=12", "traces.batch_size=4", "traces.concurrency=2", "traces.max_new_tokens=48",
         "traces.min_tokens=0", "traces.min_new_tokens=0", "traces.do_sample=false"]


def test_a_killed_client_resends_only_the_prompts_without_a_completion(server, tmp_path):
    out, sets = tmp_path / "srv", SMALL + served(server.url)
    cmd = [sys.executable, "-m", "foresight", "traces", "--recipe", RECIPE, "--out", str(out), "--no-progress",
           "--set", "model.dtype=float32"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(out / "completions", 4, lambda: proc.poll() is None)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    on_disk = len(list((out / "completions").glob("prompt-*.json")))
    assert 4 <= on_disk < 12 and not (out / "dataset").exists()
    summary = traces.make_traces(smollm2(*sets), out, **QUIET)
    assert summary["requests_this_run"] == 12 - on_disk
    assert load_traces(out)["prompt_index"] == list(range(12))


def test_a_server_killed_mid_run_is_retried_then_named_and_a_rerun_completes(server, exported, tmp_path):
    dying = vllm_server(exported, tmp_path / "dying.log").start()
    out = tmp_path / "srv"
    killer = threading.Thread(target=lambda: (wait_for(out / "completions", 3, lambda: True), dying.kill()))
    killer.start()
    try:
        with pytest.raises(ServerError, match=re.escape(dying.url) + r".*after 3 attempts"):
            traces.make_traces(smollm2(*SMALL, *served(dying.url, "traces.max_retries=2")), out, **QUIET)
    finally:
        killer.join()
        dying.kill()
    on_disk = len(list((out / "completions").glob("prompt-*.json")))
    assert 3 <= on_disk < 12
    summary = traces.make_traces(smollm2(*SMALL, *served(server.url)), out, **QUIET)  # another server, same model
    assert summary["requests_this_run"] == 12 - on_disk and load_traces(out)["prompt_index"] == list(range(12))
