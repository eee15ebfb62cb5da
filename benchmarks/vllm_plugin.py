"""``make bench-vllm``: stock vLLM against the foresight plugin (``foresight.integrations.vllm``) on the same machine.

SmolLM2-135M-Instruct exported in the realbench recipe's dtype, held-out realbench prompts (chat template), greedy,
every request held to ``new_tokens`` new tokens. Each run is an offline ``LLM`` in a process of its own
(:mod:`benchmarks.vllm_run`, engine in-process so that its scheduler can be watched), with KV blocks of
``block_size`` tokens:

* **same batch**: all ``requests`` at once with room for all: decode tokens/s of stock and plugin (the scorer in float32,
  and in bfloat16: ``scorer_precision``), the plugin's own time per step and per eviction, the blocks each request
  holds after its first eviction;
* **fixed KV space**: as many blocks as ``stock_fit`` full-length requests need, ``capacity_requests`` requests
  submitted: the most that run at once (stock: vLLM's admission; plugin: its reserved admission) against the ideal
  (usable blocks ÷ the blocks of protected prompt + B + L), and the tokens/s each reaches.

The same-batch runs are repeated ``repeats`` times, interleaved (stock, plugin, plugin in bfloat16, stock, ...): the
table gives medians and each plugin/stock ratio pairs runs of the same repeat. Writes ``OUT/result-<run>[-<repeat>].json``
per run (a finished run is not repeated) and ``REPORT/README.md``.
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

from benchmarks.vllm_run import run_llm
from foresight.runtime import atomic

STOCK = {"VLLM_PLUGINS": "lora_filesystem_resolver"}  # vLLM without the foresight plugin
RECIPE = "recipes/smollm2-135m-realbench.yaml"


@dataclasses.dataclass(frozen=True)
class Bench:
    scorer: str = "scorers/smollm2-135m/sft-w256-gap"
    budget: int = 256
    interval: int = 32
    protect_prompt: bool = True
    requests: int = 16
    new_tokens: int = 1024
    block_size: int = 32
    stock_fit: int = 4
    capacity_requests: int = 16
    repeats: int = 3  # the same-batch runs, interleaved (tokens/s on a shared machine drift by ±10% between runs)


SAME_BATCH = ("stock-batch", "plugin-batch", "plugin-batch-bf16")


def export(out: Path) -> Path:
    from foresight.config.recipe import load_recipe
    from foresight.data.model_export import export_model

    model = out / "model"
    if not (model / "config.json").exists():
        export_model(load_recipe(RECIPE), model, log=print)
    return model


def held_out_prompts(model: Path, n: int) -> list[list[int]]:
    """The token ids of the recipe's first ``n`` held-out prompts (``foresight eval``'s), through the model's chat
    template."""
    from transformers import AutoTokenizer

    from foresight.config.recipe import load_recipe
    from foresight.data.prompts import encode, heldout_prompts

    tok = AutoTokenizer.from_pretrained(str(model))
    recipe = load_recipe(RECIPE)
    return [encode(p, tok) for p in heldout_prompts(recipe.task, recipe.traces, n, tok)]


def blocks_for(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def runs(b: Bench, model: Path, prompts: list[list[int]]) -> dict:
    """name -> (spec, env) of every run."""
    plugin = {"scorer": b.scorer, "budget": b.budget, "interval": b.interval, "protect_prompt": b.protect_prompt}
    longest = max(len(p) for p in prompts) + b.new_tokens
    base = dict(model=str(model), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
                max_model_len=blocks_for(longest, b.block_size) * b.block_size, max_num_batched_tokens=8192,
                enable_chunked_prefill=False, block_size=b.block_size, max_num_seqs=256)
    fixed = b.stock_fit * blocks_for(longest, b.block_size) + 1  # + vLLM's null block
    out = {}
    for name, prompt_set, extra in (("batch", prompts[:b.requests], {}),
                                    ("capacity", prompts[:b.capacity_requests], {"num_gpu_blocks_override": fixed})):
        spec = {"prompts": prompt_set, "max_tokens": [b.new_tokens] * len(prompt_set), "min_tokens": b.new_tokens}
        out[f"stock-{name}"] = ({**spec, "llm": {**base, **extra}}, STOCK)
        out[f"plugin-{name}"] = ({**spec, "llm": {**base, **extra, "additional_config": {"foresight": plugin}}}, {})
    fast = {**plugin, "scorer_precision": "bfloat16"}
    spec, _ = out["plugin-batch"]
    out["plugin-batch-bf16"] = ({**spec, "llm": {**spec["llm"], "additional_config": {"foresight": fast}}}, {})
    return out


def summary(b: Bench, results: dict, prompts: list[list[int]], again: dict) -> dict:
    """The table's rows; ``again``: name -> the later repeats' results of the same-batch runs."""
    bs = b.block_size
    protected = max(len(p) for p in prompts[:b.capacity_requests]) if b.protect_prompt else 0
    usable = b.stock_fit * blocks_for(max(len(p) for p in prompts) + b.new_tokens, bs)
    ideal = usable // blocks_for(protected + b.budget + b.interval, bs)
    out = {}
    for name, r in results.items():
        runs_ = [r, *again.get(name, [])]
        rates = [x["new_tokens"] / x["seconds"] for x in runs_]
        row = {"tokens_per_s": float(np.median(rates)), "tokens_per_s_runs": rates, "max_running": max(r["running"]),
               "mean_running": sum(r["running"]) / len(r["running"]),
               "preemptions": len(r["preempted"]), "errors": r["finish"].count("error")}
        if r["plugin_stats"]:
            sts = [x["plugin_stats"] for x in runs_]
            row["plugin_ms_per_step"] = float(np.median([1000 * x["seconds"] / max(1, x["steps"]) for x in sts]))
            row["ms_per_eviction"] = float(np.median([1000 * x["eviction_seconds"] / max(1, x["evictions"])
                                                      for x in sts]))
            row["plugin_share"] = float(np.median([x["seconds"] / y["seconds"] for x, y in zip(sts, runs_)]))
        after = [blocks for i, p in enumerate(prompts) if str(i) in r["held"]
                 for computed, blocks in r["held"][str(i)]
                 if computed > (len(p) if b.protect_prompt else 0) + b.budget + b.interval]
        row["max_blocks_after_first_eviction"] = max(after) if after else None
        out[name] = row
    for name in SAME_BATCH[1:]:  # each repeat's plugin run against the stock run beside it
        ratios = [p / q for p, q in zip(out[name]["tokens_per_s_runs"], out["stock-batch"]["tokens_per_s_runs"])]
        out[name]["ratio_to_stock"] = {"median": float(np.median(ratios)), "runs": ratios}
    out["ideal_running"] = ideal
    out["bound_blocks_per_request"] = blocks_for(protected + b.budget + b.interval, bs)
    return out


def report(b: Bench, s: dict, path: Path) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# The foresight vLLM plugin against stock vLLM (SmolLM2-135M, vLLM's CPU build)", "",
        f"Command: `make bench-vllm` (`python -m benchmarks.vllm_plugin`). Commit {commit}, "
        f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        "no GPU. Settings: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(b).items()) + ".", "",
        "bfloat16 (the realbench recipe's dtype), greedy, every request held to its new tokens; offline `LLM`, engine "
        "in-process; KV blocks of "
        f"{b.block_size} tokens. GPU figures: not measured (no GPU was lent).", "",
        "| run | requests running: max / mean per step | tokens/s | plugin ms/step | ms/eviction | plugin share | "
        "blocks/request past P+B+L | preemptions | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ("stock-batch", "plugin-batch", "plugin-batch-bf16", "stock-capacity", "plugin-capacity"):
        r = s[name]
        fmt = lambda k, f="{:.1f}": f.format(r[k]) if r.get(k) is not None else "–"  # noqa: E731
        lines.append(f"| {name} | {r['max_running']} / {r['mean_running']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{fmt('plugin_ms_per_step')} | "
                     f"{fmt('ms_per_eviction')} | {fmt('plugin_share', '{:.0%}')} | "
                     f"{fmt('max_blocks_after_first_eviction', '{}')} | {r['preemptions']} | {r['errors']} |")
    batch, fast = (s[n]["ratio_to_stock"] for n in SAME_BATCH[1:])
    spread = lambda r: f"**{r['median']:.2f}x** (runs {min(r['runs']):.2f}–{max(r['runs']):.2f})"  # noqa: E731
    cap = s["plugin-capacity"]["max_running"]
    lines += ["", f"- Same batch ({b.repeats} interleaved runs each, medians in the table): the plugin decodes at "
              f"{spread(batch)} stock's tokens/s with the scorer in float32 (the trained scores exactly), "
              f"{spread(fast)} with `scorer_precision: bfloat16` (its loss ratio: `loss.md`); each ratio pairs a "
              "plugin run with the stock run of the same repeat.",
              f"- Fixed KV space (the blocks of {b.stock_fit} full-length requests): stock admits requests by their "
              f"prompts and preempts when the blocks run out ({s['stock-capacity']['preemptions']} preemptions, each "
              f"recomputed); the plugin's reserved admission ran up to {cap} at once with none (ideal "
              f"{s['ideal_running']}: usable blocks ÷ {s['bound_blocks_per_request']} blocks of the longest protected "
              f"prompt + B + L; shorter prompts need fewer), at "
              f"{s['plugin-capacity']['tokens_per_s'] / s['stock-capacity']['tokens_per_s']:.2f}x stock's tokens/s.",
              "", "Raw results: `result-*.json` in the run folder; the table: `summary.json` here."]
    atomic.write_text(path / "README.md", "\n".join(lines) + "\n")
    atomic.write_json(path / "summary.json", s, indent=1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench-vllm")
    ap.add_argument("--report", default="docs/results/smollm2-135m/vllm-plugin")
    ap.add_argument("--requests", type=int, default=Bench.requests)
    ap.add_argument("--new-tokens", type=int, default=Bench.new_tokens)
    args = ap.parse_args(argv)
    b = Bench(requests=args.requests, capacity_requests=args.requests, new_tokens=args.new_tokens)
    out = Path(args.out)
    model = export(out)
    prompts = held_out_prompts(model, max(b.requests, b.capacity_requests))
    plan = runs(b, model, prompts)
    order = [(name, name) for name in plan] + [(f"{name}-{i}", name) for i in range(1, b.repeats) for name in SAME_BATCH]
    results, again = {}, {}
    for label, name in order:
        done = out / f"result-{label}.json"
        if not done.exists():
            print(f"[bench-vllm] {label} ...", flush=True)
            spec, env = plan[name]
            atomic.write_json(done, run_llm(out / label, spec, env=env, timeout=3600))
        r = json.loads(done.read_text())
        print(f"[bench-vllm] {label}: {r['new_tokens'] / r['seconds']:.1f} tokens/s", flush=True)
        if label == name:
            results[name] = r
        else:
            again.setdefault(name, []).append(r)
    report(b, summary(b, results, prompts, again), Path(args.report))


if __name__ == "__main__":
    main()
