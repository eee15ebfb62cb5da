"""Fault injection (``make faults``): kill each stage (traces, sft, grpo) with SIGKILL at random points, resume it,
and check that the results are bit-identical to an uninterrupted run.

    python tests/faults.py --trials 3 --kills 2      # = make faults

Each trial runs the three stages on the embedded teacher at a tiny size; each stage is killed ``--kills`` times at a
uniformly random moment of its reference duration, then run to the end (``--resume`` when it has a checkpoint).
Prints one line per stage and trial and exits non-zero when any result differs.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=8",
        "traces.batch_size=2", "traces.require_correct=false", "traces.min_new_tokens=5", "traces.max_new_tokens=40",
        "cache.budget=12", "cache.interval=4", "sft.steps=8", "sft.batch_traces=2", "sft.ckpt_every=2",
        "grpo.steps=6", "grpo.traces_per_step=2", "grpo.group=4", "grpo.ckpt_every=2", "grpo.warmup=1"]


def command(stage: str, root: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "foresight", stage, "--recipe", "recipes/tiny-qwen3.yaml", "--no-progress",
           "--out", str(root / stage)] + [x for s in SETS for x in ("--set", s)]
    if stage != "traces":
        cmd += ["--traces", str(root / "traces")]
    if stage == "grpo":
        cmd += ["--init", str(root / "sft")]
    return cmd + (["--resume"] if resume else [])


def run(stage: str, root: Path, kill_after: float | None = None) -> tuple[int, float]:
    """Run a stage (resuming when it has a checkpoint); with ``kill_after``, SIGKILL it then. (exit code, seconds)"""
    resume = (root / stage / "ckpt" / "state.pt").exists()
    t0 = time.time()
    p = subprocess.Popen(command(stage, root, resume), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        try:
            p.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
    err = p.communicate()[1]
    if p.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"{stage} failed ({p.returncode}): {err[-2000:]}")
    return p.returncode, time.time() - t0


def result(stage: str, root: Path):
    if stage == "traces":
        from foresight.data.trace_data import load_traces

        return load_traces(root / "traces").to_list()
    from safetensors.torch import load_file

    return load_file(str(root / stage / "model.safetensors"))


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return a == b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--kills", type=int, default=2, help="kills per stage and trial")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    base = Path(tempfile.mkdtemp(prefix="foresight-faults-"))
    ok = True
    try:
        ref, seconds = base / "ref", {}
        for stage in ("traces", "sft", "grpo"):
            seconds[stage] = run(stage, ref)[1]
        for t in range(a.trials):
            root = base / f"trial{t}"
            for stage in ("traces", "sft", "grpo"):
                if stage != "traces":  # later stages start from the reference's inputs
                    src = {"sft": ["traces"], "grpo": ["traces", "sft"]}[stage]
                    for s in src:
                        if not (root / s).exists():
                            shutil.copytree(ref / s, root / s, symlinks=True)
                kills, done = 0, False
                for _ in range(a.kills):
                    code, _ = run(stage, root, kill_after=rng.uniform(0.5, seconds[stage]))
                    kills += code != 0
                    done = code == 0 or (stage != "traces" and (root / stage / "metrics.json").exists())
                    if done:  # it finished (a kill may come after its last file)
                        break
                while not done:
                    done = run(stage, root)[0] == 0
                good = same(result(stage, root), result(stage, ref))
                ok &= good
                print(f"trial {t} {stage}: {kills} kill(s), then resumed: {'bit-identical' if good else 'DIFFERENT'}",
                      flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
