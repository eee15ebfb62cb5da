"""Eviction policies, one small module each; :func:`make_policy` builds one by name."""

from foresight.policies import h2o, keydiff, knorm, lookahead, random, rkv, scissorhands, snapkv, streaming, tova  # noqa: F401
from foresight.policies.base import REGISTRY, Policy, pool_group, register


def make_policy(name: str, **kwargs) -> Policy | None:
    """A policy by name; ``full`` means no eviction (returns None)."""
    if name == "full":
        return None
    if name not in REGISTRY:
        raise ValueError(f"unknown eviction policy {name!r}; known: full, {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](**kwargs)


__all__ = ["Policy", "REGISTRY", "make_policy", "pool_group", "register"]
