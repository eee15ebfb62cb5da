"""House rules over the project's Python: no function takes more than 8 parameters (settings objects carry the rest),
no ``**_``-style catch-all swallows misspelt keyword arguments, and no file grows past 300 lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("foresight", "benchmarks", "studies", "data_prep", "tests")
MAX_PARAMETERS = 8
MAX_LINES = 300


def _files():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def offences(source: str, name: str = "<source>") -> list[str]:
    """Each function of ``source`` with more than ``MAX_PARAMETERS`` parameters (``self`` and ``cls`` not counted;
    positional, keyword and keyword-only all count) or a ``**_``-style catch-all."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
        if len(params) > MAX_PARAMETERS:
            out.append(f"{name}:{node.lineno} {node.name} takes {len(params)} parameters")
        if a.kwarg is not None and a.kwarg.arg.startswith("_"):
            out.append(f"{name}:{node.lineno} {node.name} swallows keyword arguments (**{a.kwarg.arg})")
    return out


def test_the_checker_flags_a_nine_parameter_function_and_a_swallowing_one():
    assert offences("def f(a, b, c, d, e, f, g, h):\n    pass\n") == []
    assert offences("class C:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n") == []  # self not counted
    assert offences("def f(a, b, c, d, e, f, g, h, i):\n    pass\n") == ["<source>:1 f takes 9 parameters"]
    assert offences("def f(a, *, b, c, d, e, f, g, h, i):\n    pass\n") == ["<source>:1 f takes 9 parameters"]
    assert offences("def f(a, **_):\n    pass\n") == ["<source>:1 f swallows keyword arguments (**_)"]
    assert offences("def f(a, **kwargs):\n    pass\n") == []  # a named catch-all that is passed on is fine


def test_no_function_has_more_than_8_parameters_or_swallows_keywords():
    found = [o for f in _files() for o in offences(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_no_file_is_over_300_lines():
    long = [f"{f.relative_to(ROOT)}: {n} lines" for f in _files() if (n := f.read_text().count("\n")) > MAX_LINES]
    assert not long, "\n".join(long)
