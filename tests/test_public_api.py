"""The package root is the public API: every name it lists resolves (lazily, so ``import foresight`` stays light) to
the object of the module that defines it."""

import subprocess
import sys

import pytest

import foresight


def test_every_exported_name_resolves_to_its_definition():
    from foresight.config.eviction import EvictionSettings
    from foresight.engine.generate import generate
    from foresight.engine.rollout import rollout
    from foresight.integrations.hf import ForesightCache
    from foresight.policies import make_policy
    from foresight.policies.base import Policy, register
    from foresight.scorers.checkpoint import load_scorer

    assert foresight.ForesightCache is ForesightCache and foresight.load_scorer is load_scorer
    assert foresight.Policy is Policy and foresight.register is register and foresight.make_policy is make_policy
    assert foresight.EvictionSettings is EvictionSettings and foresight.generate is generate
    assert foresight.rollout is rollout
    for name in foresight.__all__:
        assert getattr(foresight, name) is not None, name
    assert set(dir(foresight)) == set(foresight.__all__)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        foresight.no_such_thing  # noqa: B018


def test_importing_the_package_loads_neither_torch_nor_transformers():
    code = "import sys, foresight; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_every_module_of_the_library_benchmarks_and_studies_imports():
    """The fast tier touches every module: each one imports (kvpress's adapter only where kvpress is installed, the
    vLLM logits processor only where vLLM is)."""
    import importlib
    import importlib.util
    import pkgutil

    names = []
    for root in ("foresight", "benchmarks", "studies"):
        pkg = importlib.import_module(root)
        names += [m.name for m in pkgutil.walk_packages(pkg.__path__, root + ".") if not m.name.endswith("__main__")]
    if importlib.util.find_spec("kvpress.presses") is None:  # (tests/kvpress is a namespace "kvpress" on the path)
        names.remove("foresight.integrations.kvpress")
    if importlib.util.find_spec("vllm.v1") is None:  # (tests/vllm is a namespace "vllm" on the path too)
        names.remove("benchmarks.vllm_forced")
    assert len(names) > 90
    for name in names:
        importlib.import_module(name)
