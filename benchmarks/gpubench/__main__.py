"""``python -m benchmarks.gpubench``: the command line, and the parent run: one child process per row (``--row NAME``,
which prints JSON lines), each given what is left of the time budget; ``gpubench.json`` and ``gpubench.md`` rewritten
after every row. The rows themselves are described in the package's docstring (``--help``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

from benchmarks import gpubench

from foresight.runtime import atomic
from benchmarks.gpubench.rows import CUDA_ONLY, ROWS, run_row
from benchmarks.gpubench.configs import SHAPES, BenchSettings
from benchmarks.gpubench.table import gpu_table


def _child(name: str, s: BenchSettings, deadline: float, grace: float = 60.0) -> tuple[list[dict], dict]:
    """Run one row in a fresh process; (its measurements, its meta). A failed or killed child still gives what it
    printed, plus an entry saying what went wrong."""
    cmd = [sys.executable, "-m", "benchmarks.gpubench", "--row", name, "--settings", json.dumps(dataclasses.asdict(s)),
           "--deadline", repr(deadline)]
    timeout = max(deadline - time.time(), 0) + grace
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, err = res.stdout, res.stderr
        problem = ("error", f"exit status {res.returncode}") if res.returncode else None
    except subprocess.TimeoutExpired as e:
        out, err = _text(e.stdout), _text(e.stderr)
        problem = ("skipped", f"time budget (killed after {timeout:.0f} s)")
    entries, meta = [], {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        obj = json.loads(line)
        if "meta" in obj:
            meta.update(obj["meta"])
        else:
            entries.append(obj)
    if problem:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        kind, what = problem
        entries.append({"row": name, "case": "(row)", kind: what + (f": {last}" if last else ""), "stderr_tail": err[-3000:]})
    return entries, meta


def _versus_full(entries: list[dict]) -> None:
    """Decoding: each measurement's ms/token over the full cache's at the same batch (``vs_full``), where both ran."""
    full = {e["batch"]: e["ms_per_token"] for e in entries if e.get("policy") == "full" and "ms_per_token" in e}  # eager
    for e in entries:
        if e["row"] == "decode" and "ms_per_token" in e and e["batch"] in full:
            e["vs_full"] = round(e["ms_per_token"] / full[e["batch"]], 3)


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def machine() -> dict:
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": metadata.version("transformers"),
            "cuda": torch.version.cuda}


def _write(out: Path, report: dict) -> None:
    atomic.write_json(out / "gpubench.json", report, indent=1)
    atomic.write_text(out / "gpubench.md", gpu_table(report) + "\n")


def run(s: BenchSettings, rows: list[str], out: Path, time_budget: float) -> dict:
    """Every row in a child of its own, each given what is left of the time budget; the report rewritten after each."""
    start = time.time()
    report = {"machine": machine(), "device": {"requested": s.device, "name": "?"}, "shape": {"name": s.shape, **SHAPES[s.shape]},
              "settings": dataclasses.asdict(s), "time_budget_s": time_budget, "row_seconds": {}, "rows": []}
    for name in rows:
        t = time.time()
        if name in CUDA_ONLY and s.device != "cuda":
            entries = [{"row": name, "case": "(row)", "skipped": "cuda only"}]
        elif time.time() - start > time_budget:
            entries = [{"row": name, "case": "(row)", "skipped": "time budget"}]
        else:
            entries, meta = _child(name, s, start + time_budget)
            _versus_full(entries)
            if meta:
                report["device"].update(name=meta.pop("device_name"), **meta)
        report["rows"] += entries
        report["row_seconds"][name] = round(time.time() - t, 1)  # the child's start (imports, model) included
        report["elapsed_s"] = round(time.time() - start, 1)
        _write(out, report)
        for e in entries:
            print(json.dumps(e), flush=True)
    return report


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{flag} takes comma-separated integers, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpubench", description=gpubench.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--shape", help=f"one of {', '.join(SHAPES)} (default: qwen3-4b on cuda, tiny on cpu)")
    ap.add_argument("--out", type=Path, default=Path("bench-gpu"), help="folder for gpubench.json and gpubench.md")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds; later rows are skipped past it")
    ap.add_argument("--budget", "-B", type=int, help="cache budget B")
    ap.add_argument("--interval", "-L", type=int, help="eviction interval L")
    ap.add_argument("--lengths", help="comma-separated sequence lengths (the middle one for single-length rows)")
    ap.add_argument("--batches", help="comma-separated decoding batch sizes")
    for flag in ("group", "new-tokens", "memory-prompt", "memory-batch", "fit-cap", "launch-chunks", "repeat", "seed"):
        ap.add_argument(f"--{flag}", type=int)
    ap.add_argument("--temperature", type=float, help="the Top-2L sampler's temperature (group row)")
    ap.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # a child: one row, JSON lines on stdout
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    return ap


def settings_from(args) -> BenchSettings:
    if args.device not in ("cuda", "cpu"):
        raise ValueError(f"unknown device {args.device!r}; use cuda or cpu")
    s = BenchSettings.defaults(args.device)
    changes = {k: getattr(args, k) for k in ("shape", "budget", "interval", "group", "new_tokens", "memory_prompt",
                                             "memory_batch", "fit_cap", "launch_chunks", "repeat", "seed", "temperature")
               if getattr(args, k) is not None}
    for k in ("lengths", "batches"):
        if getattr(args, k):
            changes[k] = _ints(k, getattr(args, k))
    s = dataclasses.replace(s, **changes)
    s.check()
    return s


def _settings_json(text: str) -> BenchSettings:
    return BenchSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()})


def _cuda_check(s: BenchSettings) -> None:
    if s.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda was requested but CUDA is not available here (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda}); use --device cpu --shape tiny for a CPU run")


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        s = settings_from(args) if args.settings is None else _settings_json(args.settings)
        _cuda_check(s)
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = [r for r in rows if r not in ROWS]
        if unknown or not rows:
            raise ValueError(f"unknown row(s) {', '.join(unknown) or '(none given)'}; rows: {', '.join(ROWS)}")
    except ValueError as e:
        ap.error(str(e))
    if args.row:  # a child (or one row on its own): its JSON lines only
        run_row(args.row, s, args.deadline)
        return 0
    report = run(s, rows, args.out, args.time_budget)
    print(gpu_table(report))
    return 1 if any("error" in e for e in report["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
