"""The eviction settings: B, L, sinks, the protected window and prompt, the selection rule and the cache's allocation
(whole heads, per-layer budgets) — a recipe's ``cache`` section, passed whole to the cache, the drivers, golden
labels and the evaluation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from foresight.config.allocation import parse_layer_budgets, parse_whole_heads
from foresight.config.checks import SELECTIONS


@dataclass
class EvictionSettings:
    """How a bounded cache evicts (the recipe's ``cache`` section), passed whole to the cache, the drivers
    (``rollout``, ``generate``), golden labels and evaluation. Per-run facts (the prompt length, a recorder, a
    generator) travel beside it."""

    budget: int = 512  # B: pairs kept per (sequence, layer, KV head) after each eviction
    interval: int = 128  # L: tokens between evictions (the cache goes from B+L back to B)
    sinks: int = 0  # first tokens always kept
    window: int | None = None  # newest tokens protected (None: L, the paper's scheme, or a policy's own layout)
    protect_prompt: bool = False  # keep every prompt token; the budget applies to the generated part
    prompt_overflow: str = "error"  # error | evict: what to do when a protected prompt exceeds the budget
    selection: str = "topk"  # topk (deterministic) | sample (the paper's Top-2L sampler) | multinomial (all candidates)
    temperature: float = 1.0  # softmax temperature of the sampler
    # "LAYER:HEAD" KV heads that keep every pair (never evicted) while the others hold B (foresight.engine.cache.whole_heads)
    whole_heads: list[str] = field(default_factory=list)
    # "LAYERS:WEIGHT" shares of the budget per layer, the mean per-layer budget staying B (foresight.engine.cache.layer_budgets)
    layer_budgets: list[str] = field(default_factory=list)

    def replace(self, **changes) -> "EvictionSettings":
        return dataclasses.replace(self, **changes)

    def key(self) -> tuple:
        """The settings as a hashable tuple (for keys and stored identities); without whole heads and layer budgets,
        the tuple the settings had before those existed, so that stores keyed by it stay valid."""
        values = tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                       if f.name not in ("whole_heads", "layer_budgets"))
        if self.whole_heads:
            values = (*values, tuple(self.whole_heads))
        return values if not self.layer_budgets else (*values, ("layer_budgets", *self.layer_budgets))

    def protected_prefix(self, prompt_len: int | None) -> int:
        """Tokens kept besides the budget: the prompt when it is protected and fits the budget (a longer one is
        evicted as usual under ``prompt_overflow=evict``, refused under ``error``)."""
        return prompt_len if self.protect_prompt and prompt_len and prompt_len <= self.budget else 0

    def validate(self) -> None:
        """Refuse impossible settings with a message that names the problem."""
        budget, interval, sinks, window = self.budget, self.interval, self.sinks, self.window
        if budget <= 0:
            raise ValueError(f"cache budget must be > 0, got {budget}")
        if interval <= 0:
            raise ValueError(f"eviction interval must be > 0, got {interval}")
        if interval >= budget:
            raise ValueError(f"eviction interval L={interval} must be smaller than the budget B={budget}")
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        if window is None and budget < sinks + interval:
            raise ValueError(f"budget B={budget} must be at least sinks + interval = {sinks} + {interval}")
        if window is not None:
            if window < 0:
                raise ValueError(f"protected window must be >= 0, got {window}")
            if budget < sinks + window:
                raise ValueError(f"budget B={budget} must be at least sinks + window = {sinks} + {window}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.prompt_overflow not in ("error", "evict"):
            raise ValueError(f"prompt_overflow must be 'error' or 'evict', got {self.prompt_overflow!r}")
        parse_whole_heads(self.whole_heads)
        parse_layer_budgets(self.layer_budgets)
