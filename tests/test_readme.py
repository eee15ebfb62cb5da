"""The README's snippets do what it says: every Python block runs and prints what the README promises (the kvpress
block runs in its own environment: tests/kvpress), every ``make`` target it names exists, and every ``foresight``
command it shows parses."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def snippets(section: str, lang: str = "python") -> list[str]:
    text = README.read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", body, re.S)


def all_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def run_printing(code: str, ns: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, ns)  # noqa: S102
    return out.getvalue()


def test_readme_starts_with_the_two_commands_and_stays_a_front_door():
    lines = [x for x in README.read_text().splitlines() if x.startswith("make ")]
    assert lines[0].startswith("make demo") and lines[1].startswith("make test")
    assert len(README.read_bytes()) <= 15_000
    head = "\n".join(README.read_text().splitlines()[:120])
    assert "## Install" in head and "make traces" in head and "foresight eval" in head


def test_every_python_block_is_one_of_the_tested_ones():
    tested = snippets("Use trained scorers in your own code") + snippets("Write your own eviction policy")
    assert all_blocks("python") == tested


@pytest.mark.slow
def test_transformers_snippet_solves_the_problem_it_prints(monkeypatch):
    """The shipped GRPO scorer of the embedded teacher, at the README's budget: the answer is checked and right."""
    code = snippets("Use trained scorers in your own code")[0]
    monkeypatch.chdir(ROOT)
    ns: dict = {}
    printed = run_printing(code, ns)
    assert "correct: True" in printed.splitlines()
    held = int(re.search(r"pairs per KV head held: (\d+)", printed).group(1))
    assert held == ns["cache"].held() <= 640 + 128 and ns["cache"].steps > 0
    assert ns["out"].shape[1] > ns["input_ids"].shape[1] + 1_100  # the 1,201-token solution fits the budget of tokens


def test_policy_snippet_prints_its_reads_and_gets_only_what_it_declares():
    import torch

    from foresight import EvictionSettings, rollout
    from foresight.config.recipe import ModelConfig
    from foresight.engine.cache.bounded import BoundedCache
    from foresight.engine.models import load_model
    from foresight.policies.base import REGISTRY

    (code,) = snippets("Write your own eviction policy")
    ns: dict = {}
    try:
        assert run_printing(code, ns).strip() == "H2ORecent8 ['cum', 'w8']"
        model, _ = load_model(ModelConfig(), device="cpu")
        ids = torch.randint(8, 170, (1, 400), generator=torch.Generator().manual_seed(0))
        steps = []
        r = rollout(model, ids, ns["policy"], EvictionSettings(budget=128, interval=32), recorder=steps.append)
        assert len(steps) == (400 - 160) // 32 + 1 and torch.isfinite(r.token_loss).all()
        c = BoundedCache(model.config, ns["policy"], EvictionSettings(budget=128, interval=32))  # computes cum and w8 only
        with torch.no_grad():
            s = 0
            while s < 200:
                q = c.next_chunk(200 - s)
                model(input_ids=ids[:, s:s + q], cache=c, use_cache=True, **c.feed(torch.ones(1, q, dtype=torch.bool)))
                s += q
        v = c.view()
        assert v.stats["w8"].shape == v.stats["cum"].shape
        with pytest.raises(KeyError, match="h2o-recent8"):
            v.stats["max"]
    finally:
        REGISTRY.pop("h2o-recent8", None)


def test_every_make_target_in_the_readme_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    named = {m for block in all_blocks("bash") for m in re.findall(r"^make ([\w-]+)", block, re.M)}
    named |= set(re.findall(r"`make ([\w-]+)", README.read_text()))
    assert named and not named - targets, f"the README names make targets the Makefile lacks: {sorted(named - targets)}"


def test_every_foresight_command_in_the_readme_parses():
    """Each shown command parses, and its recipe with its overrides loads where the recipe is a real file."""
    from foresight import cli, load_recipe

    seen = 0
    for block in all_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if not line.startswith("foresight "):
                continue
            args = cli.build_parser().parse_args(shlex.split(line.split("#")[0])[1:])
            if getattr(args, "recipe", None) and (ROOT / args.recipe).exists():
                load_recipe(ROOT / args.recipe, args.overrides)
            seen += 1
    assert seen >= 5
