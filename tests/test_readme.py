"""The README's snippets run (each against a freshly written scorer checkpoint for the shipped teacher)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def snippets(section: str) -> list[str]:
    text = README.read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def test_readme_starts_with_the_two_commands():
    lines = [x for x in README.read_text().splitlines() if x.startswith("make ")]
    assert lines[0].startswith("make demo") and lines[1].startswith("make test")


def test_transformers_snippet_runs(tmp_path, monkeypatch):
    from foresight.checkpoint import save_scorer
    from foresight.config import ModelConfig
    from foresight.models import describe, load_model
    from foresight.scorer import bank_for_model

    model, _ = load_model(ModelConfig(), device="cpu")
    ck = tmp_path / "runs" / "tiny-qwen3" / "grpo"
    save_scorer(bank_for_model(model), ck, describe(model), budget=320, interval=64, sinks=0, stage="grpo")
    code = snippets("Use trained scorers in your own code")
    assert len(code) == 2
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(code[0].replace("max_new_tokens=1100", "max_new_tokens=500"), ns)  # noqa: S102
    assert ns["cache"].held() <= 320 + 64 and ns["cache"].steps > 0
    # an untrained scorer may make the teacher stop early (EOS), but past the first eviction
    assert 320 + 64 < ns["out"].shape[1] <= ns["input_ids"].shape[1] + 500


def test_policy_snippet_runs_and_gets_only_what_it_declares():
    import torch

    from foresight.cache import BoundedCache
    from foresight.config import EvictionSettings
    from foresight.config import ModelConfig
    from foresight.models import load_model
    from foresight.policies.base import REGISTRY
    from foresight.rollout import rollout

    (code,) = snippets("Write your own eviction policy")
    ns: dict = {}
    try:
        exec(code, ns)  # noqa: S102
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


def test_kvpress_snippet_is_tested_in_its_environment():
    pytest.importorskip("kvpress")  # runs in .venv-kvpress (tests/kvpress has the full checks)
