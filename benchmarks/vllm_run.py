"""One offline vLLM run for the plugin's tests and benchmark, in a process of its own (vLLM's engine is one per process):
``python -m benchmarks.vllm_run SPEC OUT``. SPEC (JSON): ``llm`` (``LLM(...)`` keywords), ``prompts`` (token ids),
``max_tokens`` (one per prompt), ``min_tokens``, ``sampling`` (else greedy), ``force`` (tokens to teacher-force, one
list per prompt: their raw log-probabilities come back), ``multiprocess`` (vLLM's default processes: nothing watched);
or ``refuse``: a list of ``LLM(...)`` keywords, each expected to fail.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that its scheduler can be watched: OUT (JSON)
gets each request's tokens and finish reason, the KV blocks it held after each scheduler step, the requests running
then, the preemptions, the plugin's own time,
whether the foresight plugin was loaded and active, and the generation's seconds."""

from __future__ import annotations

import json
import os
import sys
import time


def watch(scheduler, held: dict, preempted: list, running: list) -> None:
    """Record the blocks each running request holds after every ``schedule()``, how many run, and every preemption."""
    schedule, preempt = scheduler.schedule, scheduler._preempt_request
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks

    def watched_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        running.append(len(scheduler.running))
        for req in scheduler.running:
            held.setdefault(req.request_id, []).append([req.num_computed_tokens, len(blocks.get(req.request_id, ()))])
        return out

    def watched_preempt(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler.schedule, scheduler._preempt_request = watched_schedule, watched_preempt


def sampling(spec: dict) -> list:
    """One ``SamplingParams`` per prompt: greedy, or ``spec["sampling"]`` (temperature, top_p, top_k; seeded per
    request from ``seed``), each held to its ``max_tokens``; with ``force``, those tokens and their log-probabilities."""
    from vllm import SamplingParams

    out = []
    for i, m in enumerate(spec["max_tokens"]):
        kw = dict(max_tokens=m, min_tokens=spec.get("min_tokens", 0), ignore_eos=True, temperature=0.0)
        if "sampling" in spec:
            s = spec["sampling"]
            kw.update(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], seed=s["seed"] + i)
        if "force" in spec:
            kw.update(extra_args={"force": spec["force"][i]}, logprobs=0)
        out.append(SamplingParams(**kw))
    return out


def plugin_stats(llm) -> dict | None:
    """The worker plugin's own time (steps, evictions) when the plugin ran in this process."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    plugin = getattr(getattr(worker, "model_runner", None), "foresight", None)
    return None if plugin is None else dict(plugin.stats)


def start_error(make, kwargs: dict) -> str | None:
    """The error that starting an engine with ``kwargs`` raises (None: it started)."""
    try:
        make(**kwargs)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return None


def main(spec_path: str, out_path: str) -> None:  # noqa: C901 - one run, read top to bottom
    spec = json.loads(open(spec_path).read())
    inprocess = not spec.get("multiprocess")  # vLLM's default: engine core and worker in processes of their own
    if inprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    if "refuse" in spec:  # each configuration must fail to start: its error line
        with open(out_path, "w") as f:
            json.dump({"errors": [start_error(LLM, kw) for kw in spec["refuse"]]}, f)
        return
    if "force" in spec:  # teacher forcing: the forced tokens' raw log-probabilities come back
        from benchmarks.vllm_forced import ForcedTokens

        spec["llm"]["logits_processors"] = [ForcedTokens]
    llm = LLM(**spec["llm"])
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler if inprocess else None
    held, preempted, running = {}, [], []
    if inprocess:
        watch(scheduler, held, preempted, running)
    params = sampling(spec)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - start

    def index(request_id: str) -> int:  # LLM numbers its requests 0, 1, ... in submission order ("3-1a2b")
        return int(request_id.split("-")[0])

    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "finish": [o.outputs[0].finish_reason for o in outs],
              "held": {str(index(r)): v for r, v in held.items()},
              "preempted": [index(r) for r in preempted], "running": running,
              "plugin_loaded": bool(getattr(Scheduler, "_foresight_patched", False)),
              "plugin_active": hasattr(scheduler, "foresight") if inprocess else None,
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size, "seconds": seconds,
              "new_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              "plugin_stats": plugin_stats(llm) if inprocess else None}
    if "force" in spec:
        result["logprobs"] = [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outs]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])


def run_llm(folder, spec: dict, env: dict | None = None, timeout: int = 900) -> dict:
    """Run SPEC in a fresh process (``env``: extra environment, e.g. the plugin's or ``VLLM_PLUGINS``) and return
    its OUT; a failed run raises with the end of its log."""
    import subprocess
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log = folder / "spec.json", folder / "out.json", folder / "run.log"
    spec_path.write_text(json.dumps(spec))
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "benchmarks.vllm_run", str(spec_path), str(out_path)], env=full_env,
                            stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        raise RuntimeError(f"vLLM run failed (rc={rc}):\n" + log.read_text()[-3000:])
    return json.loads(out_path.read_text())
