"""What the vLLM plugin is asked to do, and the eviction schedule both of vLLM's sides compute from it.

The settings come from vLLM's own ``additional_config={"foresight": {...}}`` (``--additional-config`` of
``vllm serve``) or, where that has none, from ``FORESIGHT_VLLM_*`` environment variables; with neither the plugin is
inert. Keys (environment: the upper-case name after ``FORESIGHT_VLLM_``):

===================  ============================================================================================
``scorer``           a foresight scorer checkpoint folder (its B, L and sinks are the defaults), or
``policy``           a heuristic by name instead (``h2o``, ``tova``, ``streamingllm``, ...: ``foresight.policies``)
``budget``           B: pairs kept per (layer, KV head) after an eviction
``interval``         L: the cache goes from B + L back to B every L decoded tokens
``sinks``            first tokens never evicted (``streamingllm``: 4 unless given)
``protect_prompt``   keep the whole prompt besides B (a prompt longer than B is evicted as usual)
``reserve``          admit a request only when the blocks its bounded cache can reach are free, beside what the
                     running ones can still claim (default true: no request is ever preempted for space; false:
                     vLLM's own optimistic admission, where a request preempted after an eviction fails)
``scorer_precision`` the scorer's first product: ``float32`` (default: the trained scores exactly, the kept sets of
                     the project's engine) or ``bfloat16`` (about 2.5× faster where the hardware has bf16 products;
                     rounding may flip near-ties)
``record``           a folder: each request's kept token indices per eviction, written when it finishes
===================  ============================================================================================

The schedule is a pure function of the settings, the prompt length and the tokens computed so far
(:class:`Schedule`): vLLM's scheduler (one process) and its worker (another) each derive the same physical length
without exchanging a message.
"""

from __future__ import annotations

import dataclasses
import json
import os

from foresight.config.eviction import EvictionSettings
from foresight.scorers.bank import PRECISIONS

PINNED_VLLM = "0.32.0"  # the vLLM release whose internals the plugin patches (.venv-vllm's)
ENV_PREFIX = "FORESIGHT_VLLM_"
KEYS = ("scorer", "policy", "budget", "interval", "sinks", "protect_prompt", "reserve", "scorer_precision", "record")
STREAMING_SINKS = 4  # foresight eval's StreamingLLM sinks


class PluginConfigError(ValueError):
    """The plugin's settings, or a vLLM setting it cannot work with, named in one line."""


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    """The plugin's settings, resolved: a scorer checkpoint or a heuristic, and the eviction settings."""

    scorer: str | None
    policy: str | None
    eviction: EvictionSettings
    record: str | None = None
    reserve: bool = True
    scorer_precision: str = "float32"

    @property
    def label(self) -> str:
        return self.policy or f"scorer {self.scorer}"


def _raw(additional_config: dict | None, environ) -> dict:
    section = (additional_config or {}).get("foresight")
    if section is not None:
        if isinstance(section, str):
            section = json.loads(section)
        if not isinstance(section, dict):
            raise PluginConfigError("additional_config['foresight'] must be a mapping of the plugin's settings")
        unknown = set(section) - set(KEYS)
        if unknown:
            raise PluginConfigError(f"additional_config['foresight']: unknown keys {sorted(unknown)}; known: "
                                    f"{', '.join(KEYS)}")
        return dict(section)
    return {k: environ[ENV_PREFIX + k.upper()] for k in KEYS if environ.get(ENV_PREFIX + k.upper(), "") != ""}


def _int(raw: dict, key: str, default):
    value = raw.get(key, default)
    if value is None:
        raise PluginConfigError(f"foresight plugin: {key} is required with policy={raw.get('policy')!r} "
                                f"({ENV_PREFIX}{key.upper()} or additional_config['foresight']['{key}'])")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PluginConfigError(f"foresight plugin: {key} must be an integer, got {value!r}") from None


def _flag(value, key: str = "protect_prompt") -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise PluginConfigError(f"foresight plugin: {key} must be true or false, got {value!r}")


def resolve(additional_config: dict | None = None, environ=None) -> PluginSettings | None:
    """The plugin's settings from vLLM's ``additional_config`` or the environment; None when it is not enabled."""
    raw = _raw(additional_config, os.environ if environ is None else environ)
    if not raw.get("scorer") and not raw.get("policy"):
        if raw:
            raise PluginConfigError(f"foresight plugin: {sorted(raw)} given without a scorer or a policy")
        return None
    if raw.get("scorer") and raw.get("policy"):
        raise PluginConfigError("foresight plugin: give a scorer checkpoint or a policy, not both")
    defaults = {"budget": None, "interval": None, "sinks": 0}
    if raw.get("scorer"):
        from foresight.scorers.checkpoint import read_config  # a clear error for a missing or foreign folder

        cfg = read_config(raw["scorer"])
        defaults = {"budget": cfg["budget"], "interval": cfg["interval"], "sinks": cfg.get("sinks", 0)}
    elif raw["policy"] == "streamingllm":
        defaults["sinks"] = STREAMING_SINKS
    eviction = EvictionSettings(budget=_int(raw, "budget", defaults["budget"]),
                                interval=_int(raw, "interval", defaults["interval"]),
                                sinks=_int(raw, "sinks", defaults["sinks"]),
                                protect_prompt=_flag(raw.get("protect_prompt", False)), prompt_overflow="evict")
    try:
        eviction.validate()
    except ValueError as e:
        raise PluginConfigError(f"foresight plugin: {e}") from None
    if raw.get("policy"):
        from foresight.policies import make_policy

        try:
            make_policy(raw["policy"])
        except ValueError as e:
            raise PluginConfigError(f"foresight plugin: {e}") from None
    precision = str(raw.get("scorer_precision", "float32"))
    if precision not in PRECISIONS:
        raise PluginConfigError(f"foresight plugin: scorer_precision must be one of {', '.join(PRECISIONS)}, got "
                                f"{precision!r}")
    if precision != "float32" and not raw.get("scorer"):
        raise PluginConfigError("foresight plugin: scorer_precision applies to a scorer checkpoint, not to a policy")
    return PluginSettings(raw.get("scorer"), raw.get("policy"), eviction, raw.get("record"),
                          _flag(raw.get("reserve", True), "reserve"), precision)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One request's eviction schedule: ``protected`` prompt slots, ``capacity`` = protected + B + L (an eviction
    is due when the physical length reaches it), ``target`` = protected + B (what an eviction leaves).

    An eviction runs after the step whose tokens bring the physical length to ``capacity`` (the project's cache
    evicts before writing the next token: the same state), never inside the prompt: a prompt longer than the
    capacity is held whole until the step that completes it, then evicted down to the target (what
    ``ForesightCache`` does with transformers' one-shot prefill)."""

    prompt_len: int
    protected: int
    capacity: int
    target: int
    interval: int

    @classmethod
    def of(cls, settings: EvictionSettings, prompt_len: int) -> "Schedule":
        protected = settings.protected_prefix(prompt_len)
        return cls(prompt_len, protected, protected + settings.budget + settings.interval,
                   protected + settings.budget, settings.interval)

    @property
    def first_eviction(self) -> int:
        """Tokens computed when the first eviction runs."""
        return max(self.prompt_len, self.capacity)

    def dropped(self, computed: int) -> int:
        """Pairs evicted per (layer, KV head) once ``computed`` tokens hold KV and that step's eviction has run."""
        if computed < self.first_eviction:
            return 0
        return self.first_eviction - self.target + self.interval * ((computed - self.first_eviction) // self.interval)

    def physical(self, computed: int) -> int:
        """Slots the request occupies after ``computed`` tokens (and that step's eviction)."""
        return computed - self.dropped(computed)

    def peak(self, max_new_tokens: int | None) -> int:
        """The most pairs per head the request ever holds (a prompt longer than the capacity, until its eviction)."""
        full = self.prompt_len + (max_new_tokens if max_new_tokens is not None else self.capacity)
        return max(self.prompt_len, min(self.capacity, full))

    def evicts_after(self, computed: int) -> bool:
        """Whether the step that brings the request to ``computed`` tokens ends with an eviction."""
        return computed >= self.first_eviction and (computed - self.first_eviction) % self.interval == 0
