"""The rows by name, and one row run in a child process: build the model, print its facts (a ``meta`` line), then the
row's measurements (one JSON line each)."""

from __future__ import annotations

import json
import platform
import time

import torch

from benchmarks.gpubench.launches import row_launches
from benchmarks.gpubench.measure import Row, weight_bytes
from benchmarks.gpubench.memory import row_fit, row_memory
from benchmarks.gpubench.configs import BenchSettings, build_model
from benchmarks.gpubench.timing import row_decode, row_golden, row_group, row_rollout

ROWS = ("rollout", "group", "golden", "decode", "memory", "fit", "launches")
CUDA_ONLY = {"fit"}
ROW_FUNCTIONS = {"rollout": row_rollout, "group": row_group, "golden": row_golden, "decode": row_decode,
                 "memory": row_memory, "fit": row_fit, "launches": row_launches}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "cpu"


def run_row(name: str, s: BenchSettings, deadline: float) -> None:
    """The child: build the model, print its facts (a ``meta`` line), then the row's measurements."""
    t = time.perf_counter()
    model = build_model(s)
    dev = model.device
    meta = {"device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name(),
            "weights_bytes": weight_bytes(model), "build_s": round(time.perf_counter() - t, 2),
            "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        meta["device_memory_bytes"] = torch.cuda.get_device_properties(dev).total_memory
    print(json.dumps({"meta": meta}), flush=True)
    ROW_FUNCTIONS[name](Row(name, deadline), model, s)
