"""``make scaling``: how far data takes the learned scorer. SFT with the realbench recipe's scorer on nested subsets of
one traces folder (66 to 1,056 training traces by default, ``sft.train_traces``), each evaluated on the same held-out
references as the heuristics and golden eviction; then a wider scorer at the largest size.

One traces folder holds every size: ``max(sizes) + val`` sampled SmolLM2 traces of the realbench prompts (the
training rows of ``data_prep/prompts/realbench.jsonl``, whose second training block lies past the held-out rows;
the held-out rows and their cached references are untouched). Its last ``val`` traces validate every size (disjoint
by prompt from all training traces), and the golden examples stored per trace (``sft.example_steps``) are computed
once and shared by every size. Steps grow with the data (``steps_for``: the recipe's 300 steps of 8 traces at 264
traces, about 9 passes over the data, the same number of passes at every size, at least half as many steps).

Stages, each skipped when its output is complete, each resuming inside itself after a kill:

1. ``traces``  ``foresight traces`` (``--set traces.engine=openai --set traces.base_url=...`` to decode through vLLM)
2. ``golden``  the golden examples of every training and validation trace (``sft.example_steps`` per trace), stored
               once under ``$FORESIGHT_CACHE`` for every run
3. ``sft``     one SFT run per size (``OUT/sft-N``); the reference size at the largest size's steps
               (``OUT/sft-R-stepsS``: the steps' share of the curve, apart from the data's); the wider scorer at the
               largest size (``OUT/sft-N-wide``); each keeping its checkpoints' scorers
4. ``val``     each run's validation curve from those snapshots (:mod:`studies.scaling_convergence`): whether it
               was still learning at its end
5. ``eval``    the heuristics and golden once (``OUT/eval-methods``), each scorer alone beside the full cache
               (``OUT/eval-sft-N``): the same references, so every pair of rows is paired trace by trace
6. ``headline`` the paper's claim at the best measured point (:mod:`studies.scaling_headline`): uniform budgets up to
               512 against every heuristic, and the recommended allocation at B' = 114 / 242 against the best
               heuristic at 2B
7. ``report``  ``REPORT/README.md``, ``REPORT/results.json`` and ``REPORT/scaling.png``

    python -m studies.data_scaling --out runs/scaling --report docs/results/smollm2-135m/data-scaling
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from foresight.config.recipe import load_recipe
from studies.realbench.run import banner, record_time, train, trained
from studies.scaling_headline import ALLOCATED, ALLOCATION

STAGES = ("traces", "golden", "sft", "val", "eval", "headline", "report")
# the heuristics within reach of the learned scorer on the 192 held-out references (docs/results/smollm2-135m/heldout192/:
# H2O, R-KV, Knorm, KeyDiff and random lie 0.08-1.5 above it there), golden eviction and the full cache
HEURISTICS = "full,golden,random-keep-prompt,streamingllm,tova,snapkv,scissorhands"


def steps_for(n: int, base_steps: int, base_traces: int) -> int:
    """SFT steps for ``n`` training traces: ``base_steps`` at ``base_traces`` (the recipe's), the same passes over the
    data at every size, and at least half of ``base_steps``."""
    return max(base_steps // 2, round(base_steps * n / base_traces))


@dataclasses.dataclass(frozen=True)
class Scaling:
    """Where the study reads and writes, and what it runs."""

    recipe_path: Path
    overrides: tuple[str, ...]
    out: Path
    report: Path
    sizes: tuple[int, ...] = (66, 132, 264, 528, 1056)
    val: int = 32
    problems: int = 192
    budgets: str = "128:32,256:32"
    wide: str = "scorer.hidden=512"
    methods: str = HEURISTICS
    stages: tuple[str, ...] = STAGES
    allocation: tuple[str, ...] = ALLOCATION  # the headline's budget allocation: recipe overrides
    allocated: str = ALLOCATED  # its B' for each of the budgets
    reference: int = 264  # the size every point is paired against (the shipped scorer's data)
    base_traces: int = 264  # the training traces the recipe's sft.steps are for (steps_for)

    def recipe(self, *extra: str):
        base = [f"traces.num_prompts={max(self.sizes) + self.val}", f"sft.val_traces={self.val}",
                f"eval.num_problems={self.problems}"]
        return load_recipe(self.recipe_path, base + list(self.overrides) + list(extra))

    def runs(self) -> list[tuple[str, int, list[str]]]:
        """(folder name, training traces, overrides) of every SFT run: the sizes smallest first (``sft-N``, the
        curve), then the reference size at the largest size's steps (``sft-R-stepsS``: steps grow with the data, so
        this run tells the steps' share of the curve from the data's; none when the steps are the same), then the
        wider scorer at the largest size (``sft-N-wide``)."""
        base = self.recipe().sft.steps
        top, steps = max(self.sizes), {n: steps_for(n, base, self.base_traces) for n in self.sizes}

        def sft_run(name: str, n: int, k: int, *extra: str) -> tuple[str, int, list[str]]:
            return name, n, [f"sft.train_traces={n}", f"sft.steps={k}", "sft.snapshots=true", *extra]

        out = [sft_run(f"sft-{n}", n, steps[n]) for n in self.sizes]
        if self.reference in steps and steps[self.reference] != steps[top]:
            out.append(sft_run(f"sft-{self.reference}-steps{steps[top]}", self.reference, steps[top]))
        return out + [sft_run(f"sft-{top}-wide", top, steps[top], self.wide)]


def run(study: Scaling) -> dict:
    out = study.out
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FORESIGHT_CACHE", str((out / "cache").resolve()))
    traces, took = out / "traces", {}
    for stage in study.stages:
        t0 = time.time()
        banner(f"{stage} -> {out}")
        if stage == "traces":
            from foresight.data.traces import make_traces

            print(make_traces(study.recipe(), traces), flush=True)
        elif stage == "golden":
            fill_golden(study)
        elif stage == "sft":
            for name, _, sets in study.runs():
                banner(f"sft {name}")
                train("sft", study.recipe(*sets), traces, out / name)
        elif stage == "val":
            from studies.scaling_convergence import validation_curves

            validation_curves(study)
        elif stage == "eval":
            evaluate(study)
        elif stage == "headline":
            from studies.scaling_headline import run_headline

            run_headline(study)
        elif stage == "report":
            from studies.scaling_report import write_report

            write_report(study)
        took[stage] = round(time.time() - t0, 1)
        record_time(out, stage, took[stage])
    return took


def fill_golden(study: Scaling) -> None:
    """Every stored golden example the SFT runs read (the largest size's training traces and the validation ones),
    computed once and timed on its own; each SFT run then finds its traces in the store."""
    from foresight.data.stage_inputs import load_stage_inputs
    from foresight.training.sft import golden_stores

    recipe = study.recipe(f"sft.train_traces={max(study.sizes)}")
    _, model, ds, train_idx, val_idx = load_stage_inputs(recipe.sft, recipe.model, study.out / "traces", 1)
    for store in golden_stores(recipe, model):
        print(f"[golden] {store.fill(train_idx + val_idx, ds)} traces computed into {store.folder}", flush=True)


def evaluate(study: Scaling) -> None:
    """The heuristics and golden once, then each trained scorer beside the full cache, on the same references; loss
    columns only (``eval.recall=false``: golden's labels for every method's recall cost ~5x a method's rollout)."""
    from foresight.evaluation.evaluate import run_eval

    recipe = study.recipe("eval.recall=false")
    run_eval(recipe, study.out / "eval-methods", methods=study.methods, budgets=study.budgets)
    scorers = [(name, study.out / name) for name, _, _ in study.runs() if trained(study.out / name)]
    for name, path in scorers:
        banner(f"eval {name}")
        run_eval(recipe, study.out / f"eval-{name}", methods="full", budgets=study.budgets, scorers=[path])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-135m-realbench.yaml"))
    ap.add_argument("--out", type=Path, default=Path("runs/scaling"))
    ap.add_argument("--report", type=Path, default=Path("docs/results/smollm2-135m/data-scaling"))
    ap.add_argument("--sizes", default="66,132,264,528,1056", help="training traces per SFT run")
    ap.add_argument("--val", type=int, default=32, help="validation traces (the folder's last)")
    ap.add_argument("--problems", type=int, default=192, help="held-out references")
    ap.add_argument("--budgets", default="128:32,256:32")
    ap.add_argument("--wide", default="scorer.hidden=512", help="the override of the wider scorer at the largest size")
    ap.add_argument("--methods", default=HEURISTICS, help="evaluated once beside the scorers")
    ap.add_argument("--allocation", action="append", help="an override of the headline's allocation (repeat it; default: "
                    + " ".join(ALLOCATION) + ")")
    ap.add_argument("--allocated", default=ALLOCATED, help="the allocation's B' for each of --budgets")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args(argv)
    stages = tuple(s.strip() for s in a.stages.split(",") if s.strip())
    if [s for s in stages if s not in STAGES]:
        ap.error(f"stages: {', '.join(STAGES)}")
    study = Scaling(a.recipe, tuple(a.overrides), a.out, a.report, tuple(int(x) for x in a.sizes.split(",")), a.val,
                    a.problems, a.budgets, a.wide, a.methods, stages, tuple(a.allocation or ALLOCATION),
                    a.allocated)
    study.recipe()  # a bad recipe or override fails before any work
    (a.out).mkdir(parents=True, exist_ok=True)
    (a.out / "study.json").write_text(json.dumps({"argv": argv if argv is not None else [], **{
        k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(study).items()}}, indent=1))
    took = run(study)
    print(f"\ndata scaling finished ({took}); report in {study.report}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
