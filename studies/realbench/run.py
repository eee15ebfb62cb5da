"""``make realbench``: the real-model benchmark. SmolLM2-135M-Instruct (``recipes/smollm2-135m-realbench.yaml``), sampled
traces of >= 1,024 tokens from the project's own prompts (``data_prep/realbench.py``), then every learned scorer
against every heuristic on held-out references, with ablations, and a report (``results.md`` plus figures).

Stages, each skipped when its output is complete (so a killed run continues where it stopped; the traces, training
and evaluation stages also resume inside themselves):

1. ``traces``      the training traces (``foresight traces``)
2. ``sft``         the SFT scorers (``foresight sft``)
3. ``grpo``        GRPO from them (``foresight grpo``)
4. ``kvpop``       KVpop's stateless scorer (``foresight sft --set sft.objective=kvpop``)
5. ``eval``        every method at every budget of ``eval.budgets`` (``foresight eval``)
6. ``predictability`` how much of golden's choice the past decides: the recall@L any scorer can reach, estimated
                   from other continuations of held-out references (:mod:`studies.realbench.predictability`)
7. ``ablations``   SFT variants (scorer inputs, width, golden pooling) and the samplers (top-L, Top-2L, multinomial),
                   at the middle budget
8. ``report``      ``REPORT/results.md``, ``REPORT/results.json`` and the figures

    python -m studies.realbench.run --out runs/realbench --report docs/results/smollm2-135m
    python -m studies.realbench.run --stages traces,sft,eval,report --set sft.steps=60   # a part, other settings

Reference traces are cached under ``OUT/cache`` (``$FORESIGHT_CACHE`` when set), so the benchmark's folder holds
everything it computed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

from foresight.runtime import atomic
from foresight.config.recipe import load_recipe

STAGES = ("traces", "sft", "grpo", "kvpop", "eval", "predictability", "ablations", "report")
# SFT variants of the paper's Table 5 and of the scorer's size and labels: (name, what it changes, overrides)
SFT_ABLATIONS = (("attn-only", "scorer inputs: attention statistics only", ["scorer.features=[attn]"]),
                 ("kv-only", "scorer inputs: key and value only", ["scorer.features=[key,value]"]),
                 ("width-16", "scorer width 16, the paper's", ["scorer.hidden=16"]),
                 ("width-64", "scorer width 64", ["scorer.hidden=64"]),
                 ("pool-max", "golden pooling: max over a block's queries (default mean)", ["sft.golden_pool=max"]),
                 ("pairs-uniform", "hinge pairs weighted alike, the paper's (default: by future-score gap)",
                  ["sft.pair_weight=uniform"]),
                 ("age", "scorer inputs: + each pair's age", ["scorer.features=[key,value,attn,age]"]))
SAMPLERS = ("topk", "sample", "multinomial")  # how a trained scorer picks its L pairs at evaluation
# 300 steps: on the 32 validation traces 300 beat 60 by -0.012 [-0.022, -0.003] at B=128 and -0.007 at B=256 (loss ratio,
# paired; docs/results/smollm2-135m/kvpop/), its boundary accuracy still rising at 60
KVPOP_SET = ["sft.objective=kvpop", "kvpop.scorer=mlp", "sft.lr=0.003", "sft.warmup=10", "sft.steps=300", "sft.batch_traces=4"]


@dataclasses.dataclass(frozen=True)
class Bench:
    """Where the benchmark reads and writes, and what it runs."""

    recipe_path: Path
    overrides: tuple[str, ...]
    out: Path
    report: Path
    stages: tuple[str, ...] = STAGES

    def recipe(self, *extra: str):
        return load_recipe(self.recipe_path, list(self.overrides) + list(extra))

    def middle_budget(self) -> str:
        budgets = self.recipe().eval.budgets.split(",")
        return budgets[len(budgets) // 2]


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def trained(folder: Path) -> bool:
    return (folder / "config.json").exists()


def train(stage: str, recipe, traces: Path, out: Path, init: Path | None = None) -> None:
    """One training stage into ``out`` unless it finished there (a killed one resumes from its checkpoint)."""
    if trained(out):
        print(f"{out} is trained; reusing it", flush=True)
        return
    resume = (out / "ckpt" / "state.pt").exists()
    if stage == "grpo":
        from foresight.training.grpo.stage import train_grpo

        train_grpo(recipe, traces, init, out, resume=resume)
    elif recipe.sft.objective == "kvpop":
        from foresight.training.kvpop import train_kvpop

        train_kvpop(recipe, traces, out, resume=resume)
    else:
        from foresight.training.sft import train_sft

        train_sft(recipe, traces, out, resume=resume)


def run(bench: Bench) -> dict:
    """The benchmark's stages in order; returns the seconds each stage took in this run."""
    out = bench.out
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FORESIGHT_CACHE", str((out / "cache").resolve()))
    recipe = bench.recipe()
    traces = out / "traces"
    took: dict[str, float] = {}
    for stage in bench.stages:
        t0 = time.time()
        banner(f"{stage} -> {out}")
        if stage == "traces":
            from foresight.data.traces import make_traces

            print(make_traces(recipe, traces), flush=True)
        elif stage == "sft":
            train("sft", recipe, traces, out / "sft")
        elif stage == "grpo":
            train("grpo", recipe, traces, out / "grpo", init=out / "sft")
        elif stage == "kvpop":
            train("sft", bench.recipe(*KVPOP_SET), traces, out / "kvpop-mlp")
        elif stage == "eval":
            from foresight.evaluation.evaluate import run_eval

            run_eval(recipe, out / "eval", scorers=[d for d in (out / "sft", out / "grpo", out / "kvpop-mlp") if trained(d)])
        elif stage == "predictability":
            from studies.realbench.predictability import Probe
            from studies.realbench.predictability import run as measure

            measure(recipe, Probe(problems=min(Probe.problems, recipe.eval.num_problems)), out / "predictability",
                    scorer=out / "sft" if trained(out / "sft") else None)
        elif stage == "ablations":
            ablations(bench)
        elif stage == "report":
            from studies.realbench.report import write_report

            write_report(out, bench.report, SFT_ABLATIONS, SAMPLERS, command=command_line(bench), took=stage_times(out),
                         main_sampler=(recipe.eval.scorer_selection, int(bench.middle_budget().split(":")[0])))
        took[stage] = round(time.time() - t0, 1)
        record_time(out, stage, took[stage])
    return took


def ablations(bench: Bench) -> None:
    """At the middle budget: the SFT and GRPO scorers evaluated with each sampler; then each SFT variant trained like
    the main SFT scorer and evaluated with it, cheapest first (the variants that read the main run's stored golden
    examples, then those that need labels of their own, each in an evaluation of its own: ``eval-ablations-NAME``),
    so that a run stopped early has the finished ones."""
    from foresight.evaluation.evaluate import run_eval

    out, traces = bench.out, bench.out / "traces"
    budget, reference = bench.middle_budget(), reference_method(bench.recipe())
    for mode in SAMPLERS:
        if mode == bench.recipe().eval.scorer_selection:
            continue  # the main evaluation's rows at this budget (the report takes them from there)
        banner(f"sampler {mode}")
        run_eval(bench.recipe(f"eval.scorer_selection={mode}"), out / f"eval-sampler-{mode}",
                 methods=reference, budgets=budget,
                 scorers=[d for d in (out / "sft", out / "grpo") if trained(d)])
    for group, members in ablation_groups():
        for name, what, sets in members:
            banner(f"ablation {name}: {what}")
            train("sft", bench.recipe(*sets), traces, out / "ablations" / name)
        scorers = [out / "sft"] + [out / "ablations" / name for name, _, _ in members]  # sft first: the variants
        # are then named foresight-sft(NAME) (a lone scorer would be plain foresight-sft)
        run_eval(bench.recipe(), out / f"eval-ablations-{group}", methods=reference, budgets=budget,
                 scorers=[d for d in scorers if trained(d)])


def reference_method(recipe) -> str:
    """The method evaluated beside the scorers in the ablation and sampler evaluations: golden when they measure
    recall@L (its rollout is what recall is measured along), else the full cache, which costs nothing (golden's labels
    and rollout are the costliest rows on a CPU, and the tables compare the learned rows only; the report pairs every
    variant with the main SFT scorer on the same traces)."""
    return "golden" if recipe.eval.recall else "full"


def ablation_groups() -> list[tuple[str, list]]:
    """The SFT variants in evaluation groups: those with the main run's golden labels together (``shared``), each
    other one alone."""
    shared = [a for a in SFT_ABLATIONS if not any(s.startswith("sft.golden_pool") for s in a[2])]
    return [("shared", shared)] + [(a[0], [a]) for a in SFT_ABLATIONS if a not in shared]


def record_time(out: Path, stage: str, seconds: float) -> None:
    """Seconds per stage over every run of the benchmark in ``out`` (a resumed stage adds up)."""
    times = stage_times(out)
    times[stage] = round(times.get(stage, 0.0) + seconds, 1)
    atomic.write_json(out / "stage_seconds.json", times, indent=1)


def stage_times(out: Path) -> dict:
    import json

    f = out / "stage_seconds.json"
    return json.loads(f.read_text()) if f.exists() else {}


def command_line(bench: Bench) -> str:
    sets = "".join(f" --set {s}" for s in bench.overrides)
    return f"python -m studies.realbench.run --recipe {bench.recipe_path} --out {bench.out} --report {bench.report}{sets}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-135m-realbench.yaml"))
    ap.add_argument("--out", type=Path, default=Path("runs/realbench"))
    ap.add_argument("--report", type=Path, default=Path("docs/results/smollm2-135m"))
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, in order (default: {','.join(STAGES)})")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args(argv)
    stages = tuple(s.strip() for s in a.stages.split(",") if s.strip())
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(STAGES)}")
    bench = Bench(a.recipe, tuple(a.overrides), a.out, a.report, stages)
    bench.recipe()  # a bad recipe or override fails before any work
    t0 = time.time()
    took = run(bench)
    print(f"\nrealbench finished in {time.time() - t0:.0f} s ({took}); report in {bench.report}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
