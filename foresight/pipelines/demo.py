"""``make demo``: the whole pipeline on the embedded default — traces → SFT → GRPO → eval — printing the
results table, one summary line per budget (best learned scorer, best heuristic, golden) and, last, the paired
GRPO-vs-SFT comparison (``eval/grpo_vs_sft.md``, :mod:`foresight.evaluation.compare`). Completed stages are skipped when run
again (traces resume; a finished SFT or GRPO checkpoint is reused), so an interrupted demo continues where it stopped.
A finished checkpoint trained by other settings than the recipe now has (an older recipe, a ``--set``) stops the demo
before anything runs, naming the differences, instead of being reported under the new settings.

    python -m foresight.pipelines.demo --recipe recipes/tiny-qwen3.yaml --out runs/tiny-qwen3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from foresight.config.recipe import load_recipe


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


# the recipe sections a finished checkpoint of each stage was trained by (as their --resume checks them)
SFT_SECTIONS = ("model", "cache", "scorer", "sft")
GRPO_SECTIONS = ("model", "cache", "grpo")


def stale_settings(stage_dir: Path, recipe, sections: tuple[str, ...]) -> list[str]:
    """How the recipe ``sections`` a finished checkpoint in ``stage_dir`` was trained by differ from ``recipe``'s
    (``section.field: old -> new``, steps included); empty when there is no finished checkpoint or nothing differs."""
    path = stage_dir / "config.json"
    if not path.exists():
        return []
    from foresight.training.runs import identity_changes

    saved = json.loads(path.read_text()).get("recipe", {})
    now = recipe.to_dict()
    now["model"].pop("device", None)  # where it ran is not what it trained
    changes = identity_changes({"recipe": saved}, {"recipe": {s: now[s] for s in sections}})
    stage = sections[-1]
    old_steps = saved.get(stage, {}).get("steps")
    if old_steps != now[stage]["steps"]:
        changes.append(f"{stage}.steps: {old_steps!r} -> {now[stage]['steps']!r}")
    return changes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=Path("recipes/tiny-qwen3.yaml"))
    ap.add_argument("--out", type=Path, default=Path("runs/tiny-qwen3"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args(argv)
    recipe = load_recipe(a.recipe, a.overrides)
    t0 = time.time()
    sft_dir, grpo_dir = a.out / "sft", a.out / "grpo"
    for stage_dir, sections in ((sft_dir, SFT_SECTIONS), (grpo_dir, GRPO_SECTIONS)):
        changes = stale_settings(stage_dir, recipe, sections)
        if changes:  # reusing it would report a run of other settings under this recipe's name
            raise SystemExit(f"{stage_dir} was trained with other settings than {a.recipe} now has "
                             f"({'; '.join(changes)}): move it away (or pass another --out) to train it again")
    from foresight.data.traces import make_traces

    banner(f"1/4 traces ({recipe.traces.num_prompts} prompts) -> {a.out / 'traces'}")
    print(make_traces(recipe, a.out / "traces"), flush=True)
    banner(f"2/4 SFT ({recipe.sft.steps} steps) -> {sft_dir}")
    if (sft_dir / "config.json").exists():
        print("SFT scorers already trained; reusing them", flush=True)
    else:
        from foresight.training.sft import train_sft

        train_sft(recipe, a.out / "traces", sft_dir, resume=(sft_dir / "ckpt" / "state.pt").exists())
    banner(f"3/4 GRPO ({recipe.grpo.steps} steps, group {recipe.grpo.group}) -> {grpo_dir}")
    if (grpo_dir / "config.json").exists():
        print("GRPO scorers already trained; reusing them", flush=True)
    else:
        from foresight.training.grpo.stage import train_grpo

        train_grpo(recipe, a.out / "traces", sft_dir, grpo_dir, resume=(grpo_dir / "ckpt" / "state.pt").exists())
    banner(f"4/4 eval ({recipe.eval.num_problems} held-out problems, budgets {recipe.eval.budgets}) -> {a.out / 'eval'}")
    from foresight.evaluation import plots, report
    from foresight.evaluation.evaluate import run_eval

    rows = run_eval(recipe, a.out / "eval", scorers=[sft_dir, grpo_dir], record=True)  # the demo's own scorers
    print("\n" + "\n".join(report.summary_lines(rows, plots.read_meta(a.out / "eval"))), flush=True)
    from foresight.runtime import atomic
    from foresight.evaluation.compare import compare, compare_table

    grpo_vs_sft = compare_table(compare(a.out / "eval", a.out / "eval", "foresight-sft", "foresight-grpo"))
    atomic.write_text(a.out / "eval" / "grpo_vs_sft.md", grpo_vs_sft)  # does GRPO beat its SFT start? (paired)
    print("\n" + grpo_vs_sft, flush=True)
    print(f"\ndemo finished in {time.time() - t0:.0f} s; figures in {a.out / 'eval'} (overview.png: accuracy and "
          "loss increase per token against the budget)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
