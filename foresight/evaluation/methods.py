"""The methods ``foresight eval`` compares: one dataclass each, complete from construction on."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from foresight.scorers.checkpoint import load_scorer, method_name, policy_from_checkpoint
from foresight.config.eviction import EvictionSettings
from foresight.policies import make_policy

STREAMING_SINKS = 4


@dataclasses.dataclass(frozen=True)
class Method:
    """One evaluated method, complete from construction on.

    ``kind``: ``full`` (no eviction), ``golden`` and ``kvpop-oracle`` (teacher-forced only: they need the future),
    or ``policy`` (a heuristic or a trained scorer). ``make_policy`` builds a fresh policy for every run (None for
    the full cache)."""

    name: str
    kind: str = "policy"
    make_policy: Callable | None = None
    protect_prompt: bool = False
    sinks: int = 0
    stateful: bool = False  # a scorer that must observe every pair (KVpop's mLSTM): no recall along golden's path
    checkpoint: Path | None = None  # a scorer checkpoint, whose model card records the evaluation
    layout: tuple[int, int] | None = None  # kvpop-oracle: KVpop's (window, sinks)
    selection: tuple[str, float] = ("topk", 1.0)  # a trained scorer's selection and sampler temperature
    whole_heads: tuple[str, ...] = ()  # the recipe's cache.whole_heads (KV heads never evicted), for every method
    layer_budgets: tuple[str, ...] = ()  # the recipe's cache.layer_budgets (shares of B per layer), for every method

    @property
    def is_full(self) -> bool:
        return self.kind == "full"

    @property
    def teacher_forced_only(self) -> bool:
        return self.kind in ("golden", "kvpop-oracle")

    def settings(self, budget: int, interval: int, overflow: str) -> EvictionSettings:
        """The eviction settings of this method at B:L (top-L selection unless the method samples)."""
        return EvictionSettings(budget=budget, interval=interval, sinks=self.sinks, protect_prompt=self.protect_prompt,
                                prompt_overflow=overflow, selection=self.selection[0], temperature=self.selection[1],
                                whole_heads=list(self.whole_heads), layer_budgets=list(self.layer_budgets))


def check_names(names: list[str]) -> list[str]:
    """The method names of a comma-separated list, each known (a clear error before any work otherwise)."""
    out = [n.strip() for n in names if n.strip()]
    if not out:
        raise ValueError("no evaluation method given (e.g. --methods full,h2o,golden)")
    for n in out:
        if n not in ("full", "golden", "kvpop-oracle", "random-keep-prompt"):
            make_policy(n)  # raises, naming the known policies
    return out


def build_methods(names: list[str], scorer_dirs: list, model, protect_all: bool,
                  kvpop_layout: tuple[int, int] = (64, 4), scorer_selection: tuple[str, float] = ("topk", 1.0),
                  cache: EvictionSettings | None = None) -> list[Method]:
    """The methods ``names`` plus one per scorer checkpoint (``scorer_selection``: how the scorers pick their
    pairs, with the sampler's temperature; ``cache``: the recipe's cache section, whose allocation every method
    shares: the KV heads kept whole, ``whole_heads``, and the layers' shares of the budget, ``layer_budgets``)."""
    out = []
    for n in names:
        n = n.strip()
        if not n:
            continue
        if n == "full":
            out.append(Method("full", "full", make_policy=lambda: None))
        elif n == "golden":
            out.append(Method(n, n, protect_prompt=protect_all))
        elif n == "kvpop-oracle":  # KVpop's teacher under the recipe's kvpop layout (window, sinks)
            out.append(Method(n, n, protect_prompt=protect_all, layout=kvpop_layout))
        elif n == "random-keep-prompt":
            out.append(Method(n, make_policy=lambda: make_policy("random"), protect_prompt=True))
        else:
            make_policy(n)  # validates the name
            out.append(Method(n, make_policy=lambda name=n: make_policy(name), protect_prompt=protect_all,
                              sinks=STREAMING_SINKS if n == "streamingllm" else 0))
    seen = {m.name for m in out}
    for d in scorer_dirs:
        bank, cfg = load_scorer(d, model)
        name = method_name(cfg)
        if name in seen:
            name = f"{name}({Path(d).name})"
        seen.add(name)
        out.append(Method(name, make_policy=lambda b=bank, c=cfg, nm=name: policy_from_checkpoint(b, c, nm),
                          protect_prompt=protect_all, stateful=bool(getattr(bank, "stateful", False)),
                          checkpoint=Path(d), selection=scorer_selection))
    if cache is None:
        return out
    return [dataclasses.replace(m, whole_heads=tuple(cache.whole_heads), layer_budgets=tuple(cache.layer_budgets))
            for m in out]
