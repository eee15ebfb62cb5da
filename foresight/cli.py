"""``foresight`` command line: one sub-command per stage; each reads a YAML recipe plus ``--set`` overrides.

    foresight traces --recipe recipes/tiny-qwen3.yaml --set traces.num_prompts=8 --out runs/traces
    foresight sft    --recipe recipes/tiny-qwen3.yaml --traces runs/traces --out runs/sft
    foresight grpo   --recipe recipes/tiny-qwen3.yaml --traces runs/traces --init runs/sft --out runs/grpo
    foresight eval   --recipe recipes/tiny-qwen3.yaml --methods full,h2o --budgets 256:64 --out runs/eval
    foresight compare runs/eval-sft runs/eval-grpo     # paired bootstrap: is the candidate better on the same traces?
    foresight heads  --recipe R --traces runs/traces --scorers runs/sft --out runs/heads  # KV heads to keep whole
    foresight export-model --recipe recipes/smollm2-135m.yaml --out runs/smollm2   # a folder vllm serve can load
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from foresight import __version__
from foresight.data.openai_client import ServerError


def _common(p: argparse.ArgumentParser, out_required: bool = True):
    p.add_argument("--recipe", type=Path, default=None,
                   help="YAML recipe, e.g. recipes/tiny-qwen3.yaml (default: the defaults of foresight.config.recipe)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a recipe field (repeatable)")
    p.add_argument("--out", type=Path, required=out_required, help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="foresight", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    ap.add_argument("--version", action="version", version=f"foresight {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("traces", help="generate, filter and score reasoning traces")
    _common(p)

    p = sub.add_parser("export-model", help="write the recipe's model as a plain transformers folder (safetensors, "
                                            "tokenizer, chat template) for vLLM, SGLang or transformers serve")
    _common(p)

    p = sub.add_parser("show-recipe", help="print the resolved recipe (after --set overrides) as YAML")
    _common(p, out_required=False)

    for name, helptext in (("sft", "train scorers on golden eviction (pairwise ranking); KVpop's scorers with "
                                   "--set sft.objective=kvpop"),
                           ("grpo", "refine scorers with GRPO")):
        p = sub.add_parser(name, help=helptext)
        _common(p)
        p.add_argument("--traces", type=Path, required=True, help="a traces folder (from `foresight traces`)")
        p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
        p.add_argument("--deepspeed", type=Path, default=None, help="DeepSpeed JSON config (multi-process runs)")
        if name == "grpo":
            p.add_argument("--init", type=Path, required=True, help="the SFT scorer checkpoint to start from")

    p = sub.add_parser("eval", help="evaluate methods and budgets on held-out problems")
    _common(p)
    p.add_argument("--methods", default=None, help="comma-separated methods (default: eval.methods)")
    p.add_argument("--budgets", default=None, help="B:L pairs, e.g. 256:64,512:128 (default: eval.budgets)")
    p.add_argument("--scorers", type=Path, action="append", default=[], help="a scorer checkpoint (repeatable)")
    p.add_argument("--record", action="store_true",
                   help="also store the results in each --scorers checkpoint (config.json and model card)")
    p.add_argument("--traces", type=Path, default=None,
                   help="evaluate on this traces folder's validation traces (its last sft.val_traces) instead of the "
                        "held-out references: for choosing settings without the test set (eval.traces)")

    p = sub.add_parser("heads", help="find the KV heads to keep whole (cache.whole_heads) and the layers' shares of the "
                                     "budget (cache.layer_budgets) for a method, on validation traces")
    _common(p)
    p.add_argument("--traces", type=Path, required=True, help="a traces folder: its validation traces are measured")
    p.add_argument("--method", default=None, help="a heuristic's name (or give --scorers)")
    p.add_argument("--scorers", type=Path, action="append", default=[], help="a scorer checkpoint")
    p.add_argument("--budgets", default="128:32", help="one B:L (default 128:32)")
    p.add_argument("--max-heads", type=int, default=3, help="at most this many heads recommended")
    p.add_argument("--shares", default="1.5,2,3",
                   help="weights tried for the best layer groups against the others' 1 (default 1.5,2,3; '' for none)")

    p = sub.add_parser("compare", help="paired comparison of two evaluated methods on the same held-out traces")
    p.add_argument("base", type=Path, help="an eval output folder (or its results.json): the baseline")
    p.add_argument("candidate", type=Path, help="an eval output folder (or its results.json): the candidate")
    p.add_argument("--base-method", default=None, help="the base's method (default: its only one besides full)")
    p.add_argument("--method", default=None, help="the candidate's method (default: its only one besides full)")
    p.add_argument("--json", type=Path, default=None, help="also write the comparison as JSON here")
    return ap


def _compare(args) -> int:
    from foresight.runtime import atomic
    from foresight.evaluation.compare import compare, compare_table

    result = compare(args.base, args.candidate, args.base_method, args.method)
    print(compare_table(result), end="")
    if args.json is not None:
        atomic.write_json(args.json, result, indent=1)
    return 0


def _error(message: str) -> int:
    """A user error: one line on stderr, exit status 2 (bugs keep their tracebacks)."""
    print(f"foresight: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "compare":  # reads evaluations only: no recipe, no model
        try:
            return _compare(args)
        except (ValueError, FileNotFoundError) as e:
            return _error(f"compare: {e}")
    from foresight.config.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        return _error(str(e))
    try:
        if args.cmd == "show-recipe":
            import yaml

            print(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
            return 0
        if args.cmd == "traces":
            from foresight.data.traces import make_traces

            summary = make_traces(recipe, args.out, progress=not args.no_progress)
            print(json.dumps(summary))
            return 0
        if args.cmd == "export-model":
            from foresight.data.model_export import export_model

            print(json.dumps(export_model(recipe, args.out)))
            return 0
        if args.cmd == "sft":  # sft.objective picks the stage: ForesightKV's golden ranking or KVpop's boundary loss
            if recipe.sft.objective == "kvpop":
                from foresight.training.kvpop import train_kvpop as train
            else:
                from foresight.training.sft import train_sft as train

            train(recipe, args.traces, args.out, resume=args.resume, deepspeed_config=args.deepspeed,
                  progress=not args.no_progress)
            return 0
        if args.cmd == "grpo":
            from foresight.training.grpo.stage import train_grpo

            train_grpo(recipe, args.traces, args.init, args.out, resume=args.resume,
                       deepspeed_config=args.deepspeed, progress=not args.no_progress)
            return 0
        if args.cmd == "eval":
            from foresight.evaluation.evaluate import run_eval

            if args.traces is not None:
                recipe.eval.traces = str(args.traces)

            run_eval(recipe, args.out, methods=args.methods, budgets=args.budgets, scorers=args.scorers,
                     progress=not args.no_progress, record=args.record)
            return 0
        if args.cmd == "heads":
            from foresight.evaluation.head_search import HeadSearch, search_heads

            search_heads(recipe, args.traces, args.out, args.method, args.scorers, args.budgets,
                         HeadSearch(max_heads=args.max_heads, shares=_floats(args.shares, "--shares")))
            return 0
    except (ValueError, FileNotFoundError, ServerError) as e:
        return _error(f"{args.cmd}: {e}")
    except (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError) as e:
        return _error(f"{args.cmd}: cannot write {e.filename}: {e.strerror}")
    return 1


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of numbers") from None


if __name__ == "__main__":
    sys.exit(main())
