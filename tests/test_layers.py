"""The package's imports point one way: cli → stages → training plumbing, checkpoint → engine → primitives.
Every import counts, those inside functions included."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "foresight"
STAGES = {"foresight.traces", "foresight.sft", "foresight.grpo", "foresight.kvpop.train", "foresight.evaluate"}
# the traces stage's reader (load_traces) is what the training stages and their plumbing take from it
TRACES_READERS = {"foresight.sft", "foresight.grpo", "foresight.kvpop.train", "foresight.training"}


def modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    g = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("foresight"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(mods)
                deps |= subs or {node.module}
        g[name] = deps - {name}
    return g


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


def test_stages_do_not_import_each_other_and_nothing_below_imports_them():
    g = graph()
    assert STAGES <= set(g)
    for m, deps in g.items():
        if m in ("foresight.cli", "foresight.demo", "foresight.__main__"):
            continue
        allowed = {"foresight.traces"} if m in TRACES_READERS else set()
        assert not (deps & STAGES) - allowed, f"{m} imports the stage(s) {sorted((deps & STAGES) - allowed)}"
        assert "foresight.cli" not in deps, m
    above_engine = STAGES | {"foresight.training", "foresight.checkpoint", "foresight.cli"}
    engine = {m for m in g if m.startswith("foresight.policies")} | {
        "foresight.scorer", "foresight.kvpop.scorers", "foresight.kvpop.target", "foresight.kvpop.topk",
        "foresight.golden", "foresight.rollout", "foresight.generate", "foresight.models"}
    for m in sorted(engine):
        assert not g[m] & above_engine, f"{m} imports {sorted(g[m] & above_engine)}"
