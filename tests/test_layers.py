"""The package's folders are its layers, and imports point one way (docs/design.md): a module's layer is its
top-level folder under ``foresight/`` (``foresight.engine.cache.bounded`` is in ``engine``). Every import counts,
those inside functions included; a module imports only its own layer or lower ones, without cycles; a stage (a
command's whole job) never imports another stage; the library never imports the benchmarks or studies beside it."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "foresight"

# lowest first; the package's top level (``__init__``, ``cli``, ``__main__``) sits above every folder
FOLDERS = ["runtime", "config", "policies", "engine", "scorers", "targets", "data", "evaluation", "training",
           "integrations", "pipelines"]
STAGES = {"data.traces", "training.sft", "training.grpo.stage", "training.kvpop", "evaluation.evaluate",
          "evaluation.head_search"}
MAX_MODULES = 15  # per folder: a reader takes in a folder at a glance


def modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def layer(name: str) -> int:
    """A module's layer: the index of its top-level folder; the top-level modules come last."""
    top = name.split(".")[0]
    if top in FOLDERS:
        return FOLDERS.index(top)
    assert name in ("", "cli", "__main__"), f"foresight.{name}: the top of foresight/ holds only folders, cli and __main__"
    return len(FOLDERS)


def imported(tree: ast.AST, importer: str) -> set[str]:
    """Every module an AST imports (absolute names), relative imports resolved against ``importer``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = importer.split(".")[:-node.level]
                base = ".".join(parent + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    g = {}
    for name, f in mods.items():
        deps = set()
        for t in imported(ast.parse(f.read_text()), "foresight." + name):
            if t == "foresight" or t.startswith("foresight."):
                t = t[len("foresight."):] if t != "foresight" else ""
                if t in mods:
                    deps.add(t)
        g[name] = deps - {name}
    return g


def test_every_module_sits_in_a_layer_folder():
    for name in modules():
        layer(name)


def test_no_folder_is_crowded():
    for folder in [p for p in PKG.rglob("*") if p.is_dir() and (p / "__init__.py").exists()]:
        n = len([f for f in folder.glob("*.py") if f.name != "__init__.py"])
        assert n <= MAX_MODULES, f"{folder.relative_to(ROOT)} holds {n} modules (at most {MAX_MODULES}): split it by job"


def test_imports_point_down_and_stages_stay_apart():
    for name, deps in graph().items():
        for d in deps:
            assert layer(d) <= layer(name), f"foresight.{name} imports foresight.{d}, a higher layer"
            if name in STAGES:
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


def test_the_library_never_imports_benchmarks_or_studies():
    for name, f in modules().items():
        bad = {t for t in imported(ast.parse(f.read_text()), "foresight." + name)
               if t.split(".")[0] in ("benchmarks", "studies", "tests")}
        assert not bad, f"foresight.{name} imports {sorted(bad)}"


@pytest.mark.parametrize("src, importer, expected", [
    ("def f():\n    from foresight.training.sft import train_sft\n", "foresight.cli",
     {"foresight.training.sft", "foresight.training.sft.train_sft"}),
    ("from . import h2o\n", "foresight.policies.base", {"foresight.policies", "foresight.policies.h2o"}),
    ("import foresight.engine.rollout as r\n", "foresight.cli", {"foresight.engine.rollout"}),
])
def test_the_checker_sees_lazy_relative_and_aliased_imports(src, importer, expected):
    assert imported(ast.parse(src), importer) == expected


def test_the_checker_finds_real_edges():
    g = graph()
    assert "engine.cache.bounded" in g["engine.rollout"]
    assert "data.traces" in g["cli"]
    assert layer("policies.h2o") == layer("policies") < layer("engine.cache.bounded") == layer("engine.rollout")
