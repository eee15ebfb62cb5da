"""``make bench-traces``: the data stage's rate in-process (``traces.engine: hf``) against a real vLLM server
(``traces.engine: openai``, vLLM's CPU build, prompts as token ids) on the same machine, with the realbench recipe's
sampling: SmolLM2-135M-Instruct, 64 prompts, >= 1,000 and at most 1,024 new tokens each (not part of the tests).

Both runs do the same work after generation (the answer check and the local full-cache scoring pass), so the
difference is the decoding. For the vLLM run the server is started first (its start-up is reported, not counted),
and the model is exported for it with ``foresight export-model`` in the recipe's dtype. vLLM's CPU worker binds its
OpenMP threads to ``--bind`` cores (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's ``auto`` leaves one core to its engine).
The server runs without chunked prefill: vLLM's CPU build fails a seeded request whose prompt is split across steps
(``CPU Generator does not use offset``), which 64 prompts arriving at once cause.

    .venv-vllm/bin/python -m benchmarks.traces_engines --out runs/bench-traces \\
        --report docs/results/smollm2-135m/vllm-traces
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

from foresight.config.recipe import load_recipe
from foresight.data import traces
from foresight.data.model_export import export_model
from studies.realbench.report import git_commit, machine
from benchmarks.servers import ServerProcess, free_port

RECIPE = "recipes/smollm2-135m-realbench.yaml"


def run_engine(name: str, sets: list[str], out: Path) -> dict:
    recipe = load_recipe(RECIPE, sets)
    t0 = time.time()
    summary = traces.make_traces(recipe, out / name, progress=False, log=lambda *_: None)
    summary["wall_seconds"] = round(time.time() - t0, 1)
    done = sorted(p.stat().st_mtime for p in (out / name / "completions").glob("prompt-*.json"))
    if done:  # the server's share: from the first request to the last completion on disk
        summary["decode_seconds"] = round(done[-1] - t0, 1)
    return summary


def server(model: Path, out: Path, args) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--enforce-eager", "--max-model-len", "2048",
           "--max-num-seqs", str(args.prompts), "--disable-log-stats", "--no-enable-chunked-prefill"]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_CPU_OMP_THREADS_BIND": args.bind}
    return ServerProcess(cmd, port, out / f"vllm-{args.bind}.log", env=env, startup=600)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", type=Path, default=None, help="write README.md and results.json here")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="the recipe's model.dtype, for both engines")
    ap.add_argument("--kv-gib", type=int, default=3, help="vLLM's KV space (64 x 1,200 bf16 tokens: 1.8 GiB)")
    ap.add_argument("--bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND: auto (vLLM's), or cores like 0-1")
    ap.add_argument("--engines", default="hf,vllm")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sets = [f"model.dtype={args.dtype}", f"traces.num_prompts={args.prompts}", f"traces.batch_size={args.prompts}"]
    if "hf" in args.engines:
        save(args.out, "hf", run_engine("hf", sets, args.out))
    if "vllm" in args.engines:
        model = args.out / f"model-{args.dtype}"
        if not model.exists():
            export_model(load_recipe(RECIPE, sets), model, log=lambda *_: None)
        t0 = time.time()
        s = server(model, args.out, args).start()
        startup = round(time.time() - t0, 1)
        try:
            sets += ["traces.engine=openai", f"traces.base_url={s.url}", f"traces.concurrency={args.prompts}"]
            save(args.out, f"vllm-{args.bind}", run_engine(f"vllm-{args.bind}", sets, args.out) |
                 {"startup_seconds": startup})
        finally:
            s.kill()
    if args.report is not None:
        write_report(args, argv)
    return 0


def save(out: Path, name: str, result: dict) -> None:
    """One engine's run, kept beside the others (the report reads every one in ``out``)."""
    print(name, json.dumps(result), flush=True)
    (out / f"result-{name}.json").write_text(json.dumps(result, indent=1) + "\n")


def write_report(args, argv) -> None:
    results = {f.stem.removeprefix("result-"): json.loads(f.read_text()) for f in sorted(args.out.glob("result-*.json"))}
    args.report.mkdir(parents=True, exist_ok=True)
    meta = {"prompts": args.prompts, "dtype": args.dtype, "cores": os.cpu_count()}
    (args.report / "results.json").write_text(json.dumps(meta | {"runs": results}, indent=1) + "\n")
    rows = ["| engine | traces | new tokens | wall s | decoding s | tokens/s | traces/min |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        rows.append(f"| {name} | {r['num_traces']} | {r['generated_tokens_this_run']} | {r['wall_seconds']} | "
                    f"{r.get('decode_seconds', '—')} | {r['generated_tokens_this_run'] / r['wall_seconds']:.1f} | "
                    f"{r['traces_per_minute']} |")
    cmd = "python -m benchmarks.traces_engines " + " ".join(argv if argv is not None else sys.argv[1:])
    text = [f"# Traces in-process vs through vLLM ({args.prompts} SmolLM2 prompts, {args.dtype})", "",
            f"- **Command:** `.venv-vllm/bin/{cmd}`", f"- **Commit:** {git_commit()}",
            f"- **Date:** {datetime.date.today().isoformat()}", f"- **Machine:** {machine()}", "", *rows, ""]
    (args.report / "README.md").write_text("\n".join(text))


if __name__ == "__main__":
    sys.exit(main())
