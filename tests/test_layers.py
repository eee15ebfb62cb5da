"""The package's imports point one way (README, "Design"): entry points → stages → training plumbing and
checkpoints → engine → primitives. Every import counts, those inside functions included; every module has a layer
(a new module must be placed here); a module imports only its own layer or lower ones, without cycles, and a stage
never imports another stage."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "foresight"

PRIMITIVES = {"config", "features", "selection", "shapes", "atomic", "handoff", "slot_attention", "statistics", "eviction",
              "cache_chunks", "cache_attention", "cache_storage", "rope_shift", "kept_queries",
              "view", "slots", "cache", "attention", "distributed", "reward", "prompts", "trace_data", "validation", "locks",
              "serving", "layer_handle", "recipe_yaml", "full_cache", "whole_heads", "layer_budgets"}
ENGINE = {"models", "rollout", "cache_fork", "generate", "static_step", "recorded", "golden", "scorer", "policies", "kvpop.topk",
          "kvpop.target", "kvpop.scorers", "golden_loss", "block_pooler"}
PLUMBING = {"training", "checkpoint", "plots", "methods", "references", "report", "divergence", "styles", "completions",
            "golden_store", "eval_resume", "realbench_report", "paired", "compare", "trace_metrics", "grpo_objective",
            "grpo_rollout", "grpo_validation", "shared_prefixes", "trace_references", "ranking", "stage_inputs",
            "realbench_goals", "eval_generation"}
STAGES = {"traces", "sft", "grpo", "kvpop.train", "evaluate", "head_search"}
ENTRY = {"", "cli", "__main__", "demo", "bench", "gpubench", "integrations", "kvpop", "opcount", "realbench", "predictability",
         "grpo_noise"}
LAYERS = [PRIMITIVES, ENGINE, PLUMBING, STAGES, ENTRY]


def modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def layer(name: str) -> int:
    """A module's layer: its own entry, or its package's (``policies.h2o`` is ``policies``)."""
    parts = name.split(".")
    for k in range(len(parts), -1, -1):
        prefix = ".".join(parts[:k])
        for i, members in enumerate(LAYERS):
            if prefix in members:
                return i
    raise AssertionError(f"foresight.{name} has no layer: add it to tests/test_layers.py")


def graph() -> dict[str, set[str]]:
    mods = modules()
    g = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for t in targets:
                if t == "foresight" or t.startswith("foresight."):
                    t = t[len("foresight."):] if t != "foresight" else ""
                    if t in mods:
                        deps.add(t)
                        break
        g[name] = deps - {name}
    return g


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_imports_point_down_and_stages_stay_apart():
    for name, deps in graph().items():
        for d in deps:
            assert layer(d) <= layer(name), f"foresight.{name} (layer {layer(name)}) imports foresight.{d} " \
                                            f"(layer {layer(d)})"
            if name in STAGES or name.startswith("kvpop.train"):
                assert d not in STAGES, f"the stage foresight.{name} imports the stage foresight.{d}"


def test_no_import_cycles():
    g = graph()
    done: set[str] = set()

    def visit(m, path):
        for d in sorted(g.get(m, ())):
            assert d not in path, "import cycle: " + " -> ".join(path[path.index(d):] + [d])
            if d not in done:
                visit(d, path + [d])
        done.add(m)

    for m in sorted(g):
        visit(m, [m])


def test_the_checker_sees_lazy_imports_and_package_imports():
    src = "def f():\n    from foresight.sft import train_sft\n    from foresight import cache\n"
    deps = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom):
            deps.add(node.module)
    assert deps == {"foresight.sft", "foresight"}
    g = graph()
    assert "traces" in g["cli"] or "traces" in g["demo"]  # entry points import stages, lazily
    assert "cache" in g["rollout"] and layer("policies.h2o") == layer("policies") == 1
