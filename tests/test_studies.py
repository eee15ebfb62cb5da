"""The study scripts under ``studies/`` still fit the code and the data they name, without running a model.

Every ``*.py`` compiles, and every ``foresight.*``, ``benchmarks.*`` and ``studies.*`` module it imports exists, as does
every name it imports from one. Every ``*.sh`` passes ``bash -n``, and every ``studies/...py`` or ``docs/results/...``
path it mentions exists. Names are resolved from the sources (``importlib.util.find_spec`` for modules, the module's
top-level definitions for names), importing a module only where its source does not define the name statically.
The checkers are tested against made-up imports and paths too, so each can fail.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ROOT / "studies"
OURS = ("foresight", "benchmarks", "studies")
PY = sorted(STUDIES.rglob("*.py"))
SH = sorted(STUDIES.rglob("*.sh"))
# a repository path a shell script names: a study script, or anything under docs/results
SH_PATH = re.compile(r"(?<![\w./-])(studies/[\w./-]+\.py|docs/results/[\w./-]*)")


def _ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The module an ``from X import y`` names, relative imports resolved against the file's package."""
    if not node.level:
        return node.module or ""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a missing parent package
        return None


def _top_level_names(origin: str) -> set[str] | None:
    """Names a module's source binds at top level, or None where it may bind more at run time."""
    tree = ast.parse(Path(origin).read_text(), origin)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                return None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*":
                    return None
                names.add(a.asname or a.name.split(".")[0])
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return names


def _has(module: str, name: str) -> bool:
    if _spec(f"{module}.{name}") is not None:  # a submodule
        return True
    spec = _spec(module)
    if spec is None:
        return False
    if spec.origin and spec.origin.endswith(".py"):
        names = _top_level_names(spec.origin)
        if names is not None and name in names:
            return True
    return hasattr(importlib.import_module(module), name)  # bound at run time, or missing


def import_problems(path: Path, root: Path = ROOT) -> list[str]:
    """What a Python file imports from this project that does not exist (empty: all there)."""
    source = path.read_text()
    compile(source, str(path), "exec")  # a SyntaxError fails the caller
    problems = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name) and _spec(a.name) is None:
                    problems.append(f"import {a.name}: no such module")
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path, root)
            if not _ours(module):
                continue
            if _spec(module) is None:
                problems.append(f"from {module}: no such module")
                continue
            problems += [f"from {module} import {a.name}: no such name or submodule"
                         for a in node.names if a.name != "*" and not _has(module, a.name)]
    return problems


def shell_problems(path: Path, root: Path = ROOT) -> list[str]:
    """``bash -n``'s complaint and the repository paths a shell script names that do not exist."""
    problems = []
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    if check.returncode:
        problems.append(f"bash -n: {check.stderr.strip()}")
    for m in SH_PATH.finditer(path.read_text()):
        p = m.group(1).rstrip(".")
        if not (root / p).exists():
            problems.append(f"{p}: no such path")
    return problems


def test_there_are_studies():
    assert PY and SH
    assert (STUDIES / "results").is_dir()
    assert not list((STUDIES / "results").rglob("__init__.py"))  # scripts, not a package


@pytest.mark.parametrize("path", PY, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_study_compiles_and_its_imports_exist(path):
    assert import_problems(path) == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("path", SH, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_study_parses_and_names_existing_paths(path):
    assert shell_problems(path) == []


def test_no_study_script_left_among_the_results():
    stray = [p for ext in ("*.py", "*.sh") for p in (ROOT / "docs" / "results").rglob(ext)]
    assert stray == []


def test_the_import_checker_flags_what_is_missing(tmp_path):
    f = tmp_path / "studies" / "probe.py"
    f.parent.mkdir()
    f.write_text("import json\n"
                 "import foresight.no_such_module\n"
                 "from benchmarks.no_such_module import x\n"
                 "from foresight.evaluation.report import paired_ratio_diff_ci, no_such_name\n"
                 "from studies import no_such_study\n"
                 "from studies.realbench import goals\n"
                 "from numpy import definitely_not_checked\n")
    assert import_problems(f, tmp_path) == [
        "import foresight.no_such_module: no such module",
        "from benchmarks.no_such_module: no such module",
        "from foresight.evaluation.report import no_such_name: no such name or submodule",
        "from studies import no_such_study: no such name or submodule",
    ]
    f.write_text("def broken(:\n")
    with pytest.raises(SyntaxError):
        import_problems(f, tmp_path)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_shell_checker_flags_bad_syntax_and_missing_paths(tmp_path):
    (tmp_path / "docs" / "results" / "here").mkdir(parents=True)
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "there.py").write_text("")
    f = tmp_path / "probe.sh"
    f.write_text("python studies/there.py docs/results/here/.\n"
                 "python studies/gone.py > docs/results/missing/out.json\n")
    assert shell_problems(f, tmp_path) == ["studies/gone.py: no such path", "docs/results/missing/out.json: no such path"]
    f.write_text("if true; then\n  echo studies/there.py\n")  # no fi
    problems = shell_problems(f, tmp_path)
    assert len(problems) == 1 and problems[0].startswith("bash -n:")
