"""The learned scorer's loss ratio through vLLM against the project's engine on the same references
(``make bench-vllm-loss``).

References: held-out realbench prompts, continued by stock vLLM with the recipe's sampling (seeded per request) to
``new_tokens`` tokens. Through vLLM, each reference is teacher-forced (:mod:`benchmarks.vllm_forced`) once by stock vLLM
(the full cache) and once with the foresight plugin; through the engine, by :func:`foresight.engine.rollout.rollout`
with the full cache and with the same scorer and settings, what ``foresight eval`` runs. The loss ratio is what
``foresight eval`` reports, Σ evicted loss / Σ full-cache loss over the generated tokens, with 95% bootstrap intervals
over the references and the paired interval of vLLM's ratio minus the engine's. float32 in both engines. Besides, the
engine with the scorer's first product in bfloat16 (``scorer_precision``), paired against float32: what the faster
setting costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.vllm_plugin import STOCK, blocks_for, held_out_prompts
from benchmarks.vllm_run import run_llm
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import load_recipe
from foresight.evaluation.paired import paired_diff_ci, percentile_interval, resampled_stat, resamples
from foresight.runtime import atomic

RECIPE = "recipes/smollm2-135m-realbench.yaml"


@dataclasses.dataclass(frozen=True)
class LossBench:
    scorer: str = "scorers/smollm2-135m/sft-w256-gap"
    budgets: tuple = (128, 256)
    interval: int = 32
    protect_prompt: bool = True
    references: int = 16
    new_tokens: int = 1024
    seed: int = 0


def references(b: LossBench, out: Path, recipe) -> tuple[Path, list, list]:
    from foresight.data.model_export import export_model

    model = out / "model-float32"
    if not (model / "config.json").exists():
        export_model(recipe, model, log=print)
    prompts = held_out_prompts(model, b.references)
    tr = recipe.traces
    spec = {"llm": llm_args(model, prompts, b), "prompts": prompts, "max_tokens": [b.new_tokens] * len(prompts),
            "min_tokens": b.new_tokens, "sampling": {"temperature": tr.temperature, "top_p": tr.top_p,
                                                     "top_k": tr.top_k, "seed": b.seed}}
    refs = cached(out / "references.json", lambda: run_llm(out / "references", spec, env=STOCK)["tokens"])
    return model, prompts, refs


def llm_args(model: Path, prompts: list, b: LossBench) -> dict:
    longest = max(len(p) for p in prompts) + b.new_tokens
    return dict(model=str(model), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
                max_model_len=blocks_for(longest, 32) * 32, max_num_batched_tokens=8192, enable_chunked_prefill=False,
                block_size=32)


def cached(path: Path, make):
    if not path.exists():
        atomic.write_json(path, make())
    return json.loads(path.read_text())


def through_vllm(b: LossBench, out: Path, model: Path, prompts: list, refs: list, budget) -> list[float]:
    """Per reference, Σ loss of its generated tokens teacher-forced through vLLM (``budget`` None: stock)."""
    spec = {"llm": llm_args(model, prompts, b), "prompts": prompts, "max_tokens": [len(r) for r in refs],
            "force": refs}
    env = STOCK
    if budget is not None:
        spec["llm"]["additional_config"] = {"foresight": {"scorer": b.scorer, "budget": budget, "interval": b.interval,
                                                          "protect_prompt": b.protect_prompt}}
        env = {}
    name = "stock" if budget is None else f"plugin-{budget}"
    return cached(out / f"vllm-{name}.json",
                  lambda: [-sum(lp) for lp in run_llm(out / f"forced-{name}", spec, env=env)["logprobs"]])


def through_engine(b: LossBench, out: Path, recipe, prompts: list, refs: list, budget,
                   precision: str = "float32") -> list[float]:
    """Per reference, Σ loss of its generated tokens teacher-forced through the project's engine (``precision``: the
    scorer's first product)."""
    from foresight.engine.models import load_model
    from foresight.engine.rollout import rollout
    from foresight.scorers.checkpoint import load_scorer, policy_from_checkpoint

    def make():
        model, _ = load_model(recipe.model)
        policy = settings = None
        if budget is not None:
            bank, cfg = load_scorer(b.scorer, model)
            policy = policy_from_checkpoint(bank, cfg, precision=precision)
            settings = EvictionSettings(budget=budget, interval=b.interval, protect_prompt=b.protect_prompt,
                                        prompt_overflow="evict")
        sums = []
        for p, r in zip(prompts, refs):
            loss = rollout(model, torch.tensor([p + r]), policy, settings, prompt_len=len(p)).token_loss[0]
            sums.append(float(loss[len(p):].sum()))
        return sums
    suffix = "" if precision == "float32" else f"-{precision}"
    return cached(out / f"engine-{'full' if budget is None else budget}{suffix}.json", make)


def interval(num: list, den: list, seed: int) -> list[float]:
    return percentile_interval(resampled_stat(num, den, resamples(len(num), seed)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench-vllm/loss")
    ap.add_argument("--report", default="docs/results/smollm2-135m/vllm-plugin")
    ap.add_argument("--references", type=int, default=LossBench.references)
    args = ap.parse_args(argv)
    b = LossBench(references=args.references)
    out = Path(args.out)
    recipe = load_recipe(RECIPE, ["model.dtype=float32"])
    model, prompts, refs = references(b, out, recipe)
    vfull, efull = through_vllm(b, out, model, prompts, refs, None), through_engine(b, out, recipe, prompts, refs, None)
    rows = []
    for budget in b.budgets:
        v, e = through_vllm(b, out, model, prompts, refs, budget), through_engine(b, out, recipe, prompts, refs, budget)
        fast = through_engine(b, out, recipe, prompts, refs, budget, "bfloat16")
        rows.append({"budget": budget, "engine": sum(e) / sum(efull), "engine_ci": interval(e, efull, b.seed),
                     "vllm": sum(v) / sum(vfull), "vllm_ci": interval(v, vfull, b.seed),
                     "vllm_minus_engine_ci": paired_diff_ci(e, efull, v, vfull, b.seed),
                     "bf16": sum(fast) / sum(efull), "bf16_minus_f32_ci": paired_diff_ci(e, efull, fast, efull, b.seed)})
    full_gap = float(np.max(np.abs(np.array(vfull) - np.array(efull)) / np.array(efull)))
    report(b, rows, full_gap, Path(args.report))


def report(b: LossBench, rows: list, full_gap: float, path: Path) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    fmt = lambda ci: f"[{ci[0]:.4f}, {ci[1]:.4f}]"  # noqa: E731
    lines = ["# The learned scorer's loss ratio through vLLM and through the project's engine", "",
             f"Command: `make bench-vllm-loss` (`python -m benchmarks.vllm_plugin_loss`). Commit {commit}, "
             f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, no GPU. Settings: "
             + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(b).items()) + ".", "",
             f"{b.references} held-out realbench prompts continued by stock vLLM (the recipe's sampling) to "
             f"{b.new_tokens} tokens, each teacher-forced through both engines in float32. Full-cache sums agree to "
             f"{full_gap:.1e} (largest relative gap of one reference).", "",
             "| B:L | engine (foresight eval's rollout) | vLLM with the plugin | vLLM − engine [paired 95%] | "
             "engine, scorer_precision bfloat16 − float32 [paired 95%] |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget']}:{b.interval} | {r['engine']:.4f} {fmt(r['engine_ci'])} | {r['vllm']:.4f} "
                     f"{fmt(r['vllm_ci'])} | {r['vllm'] - r['engine']:+.5f} "
                     f"[{r['vllm_minus_engine_ci'][0]:+.5f}, {r['vllm_minus_engine_ci'][1]:+.5f}] | "
                     f"{r['bf16'] - r['engine']:+.5f} [{r['bf16_minus_f32_ci'][0]:+.5f}, "
                     f"{r['bf16_minus_f32_ci'][1]:+.5f}] |")
    atomic.write_text(path / "loss.md", "\n".join(lines) + "\n")
    atomic.write_json(path / "loss.json", {"settings": dataclasses.asdict(b), "rows": rows, "full_gap": full_gap},
                      indent=1)


if __name__ == "__main__":
    main()
