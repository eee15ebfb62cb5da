"""What a KVpop scorer (:mod:`foresight.scorers.kvpop`) is built from: its layout, decay and sizes, and how a
checkpoint's ``scorer`` spec dict maps onto them (an unknown key is an error naming it, never silently dropped)."""

from __future__ import annotations

import dataclasses

_MLSTM_ONLY = ("memory_dim", "delayed", "block")
# keys a scorer's spec() writes that describe it rather than configure it: each must agree with the spec's sizes
_DESCRIPTIVE = ("kind", "num_key_value_heads", "features", "d_in", "activation")


@dataclasses.dataclass(frozen=True)
class KVpopSpec:
    """A KVpop scorer's settings.

    ``num_layers``, ``kv_heads``, ``head_dim``, ``group`` (query heads per KV head): the LLM's attention shape.
    ``window`` and ``sinks``: the cache layout the scorer was trained for (protected newest and first tokens).
    ``gamma`` (in (0, 1]) and ``decay_step``: the temporal decay of the static priority, ``gamma`` per
    ``decay_step`` tokens. ``hidden``: the read-out MLP's width. mLSTM only: ``memory_dim`` (the matrix memory's
    size), ``delayed`` (read a token out when it leaves the window, else at insertion) and ``block`` (tokens per
    chunk of the recurrence). ``seed``: the initial weights' (not part of a checkpoint's spec)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    group: int
    window: int
    sinks: int
    gamma: float = 0.9
    decay_step: int = 64
    hidden: int = 32
    memory_dim: int = 16
    delayed: bool = True
    block: int = 256
    seed: int = 0

    @classmethod
    def from_dict(cls, spec: dict) -> "KVpopSpec":
        """The settings of a checkpoint's ``scorer`` spec (what a scorer's ``spec()`` wrote): ``num_key_value_heads``
        is ``kv_heads``; ``kind``, ``features``, ``d_in`` and ``activation`` must agree with the rest. A key that is
        neither, or an mLSTM setting in an MLP's spec, is a ``ValueError`` naming it."""
        kind = spec.get("kind")
        allowed = {f.name for f in dataclasses.fields(cls)} - {"kv_heads", "seed"}
        if kind != "kvpop-mlstm":
            allowed -= set(_MLSTM_ONLY)
        unknown = sorted(set(spec) - allowed - set(_DESCRIPTIVE))
        if unknown:
            raise ValueError(f"{kind} scorer spec: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(allowed | set(_DESCRIPTIVE)))}")
        if "num_key_value_heads" not in spec:
            raise ValueError(f"{kind} scorer spec: num_key_value_heads missing")
        out = cls(kv_heads=spec["num_key_value_heads"], **{k: v for k, v in spec.items() if k in allowed})
        described = {"features": ["key", "value"], "d_in": 2 * out.head_dim, "activation": "silu"}
        wrong = [f"{k}={spec[k]!r} (expected {v!r})" for k, v in described.items() if k in spec and _listed(spec[k]) != v]
        if wrong:
            raise ValueError(f"{kind} scorer spec: {'; '.join(wrong)}")
        return out


def _listed(value):
    """A spec value as JSON reads it back (a tuple as a list)."""
    return list(value) if isinstance(value, tuple) else value
