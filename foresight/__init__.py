"""foresight: learned KV-cache eviction scorers (ForesightKV) for frozen LLMs.

The public API, importable from here (each name is loaded on first use, so ``import foresight`` stays light):

- ``ForesightCache``: a bounded cache that plain ``model.generate(...)`` accepts, built from a scorer checkpoint
  (``ForesightCache.from_pretrained``) or any policy;
- ``load_scorer``: a scorer checkpoint's scorers and config; ``policy_from_checkpoint`` turns them into a policy;
- ``Policy``, ``register``, ``make_policy``: the eviction-policy interface, its registry and the factory by name;
- ``EvictionSettings``: B, L, sinks and the cache's allocation (a recipe's ``cache`` section);
- ``generate``: generation under eviction (chunked prefill, then decoding); ``rollout``: a teacher-forced pass under
  eviction with per-token losses;
- ``load_recipe``: a YAML recipe with ``section.field=value`` overrides; ``load_model``: the frozen LLM it names.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ForesightCache": "foresight.integrations.hf",
    "load_scorer": "foresight.scorers.checkpoint",
    "policy_from_checkpoint": "foresight.scorers.checkpoint",
    "Policy": "foresight.policies.base",
    "register": "foresight.policies.base",
    "make_policy": "foresight.policies",
    "EvictionSettings": "foresight.config.eviction",
    "load_recipe": "foresight.config.recipe",
    "load_model": "foresight.engine.models",
    "generate": "foresight.engine.generate",
    "rollout": "foresight.engine.rollout",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'foresight' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
