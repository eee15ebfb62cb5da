"""Learned KV eviction inside vLLM: a plugin that bounds each request's cache with foresight scorers (or a heuristic).

Installed with the project (entry point ``vllm.general_plugins``), it is inert until given settings, either as
vLLM's own config::

    llm = LLM(model="runs/smollm2-export", enable_prefix_caching=False, enforce_eager=True,
              additional_config={"foresight": {"scorer": "scorers/smollm2-135m/sft-w256-gap",
                                               "budget": 256, "interval": 32}})

    python -m vllm.entrypoints.openai.api_server --model runs/smollm2-export --no-enable-prefix-caching \\
        --additional-config '{"foresight": {"scorer": "scorers/smollm2-135m/sft-w256-gap"}}'

or from the environment (``FORESIGHT_VLLM_SCORER=DIR``, ``FORESIGHT_VLLM_BUDGET=256``, ...:
:mod:`foresight.integrations.vllm.settings`). Every L decoded tokens past B + L, each request's cache goes from B + L
back to B pairs per (layer, KV head), chosen exactly as the project's engine chooses (the same statistics, features,
selection and tie order: :mod:`.request`); the kept pairs are compacted into the request's first blocks and the
freed blocks go back to vLLM's pool (:mod:`.worker`, :mod:`.scheduler`), so more requests fit. RoPE positions stay
logical. Settings the plugin cannot run with are refused at start-up (:mod:`.checks`). Pinned to vLLM 0.32.0.
"""

from __future__ import annotations

import functools
import os

from foresight.integrations.vllm.settings import ENV_PREFIX, PINNED_VLLM, PluginConfigError, resolve

__all__ = ["register", "resolve", "PluginConfigError", "PINNED_VLLM"]


def _env_enabled() -> bool:
    return any(os.environ.get(f"{ENV_PREFIX}{k}") for k in ("SCORER", "POLICY"))


def _settings_of(vllm_config):
    return resolve(getattr(vllm_config, "additional_config", None))


def register() -> None:
    """vLLM's plugin entry point: runs once in each of vLLM's processes; patches the classes it needs so that each
    scheduler and model runner built from an enabling config gets the plugin (a no-op for the others)."""
    import vllm

    if vllm.__version__.split("+")[0] != PINNED_VLLM:
        if _env_enabled():
            from foresight.integrations.vllm.checks import check_version

            check_version(vllm.__version__)
        return  # another release: inert (its internals are not the ones patched here)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(Scheduler, "_foresight_patched", False):
        return
    Scheduler._foresight_patched = True
    EngineArgs.create_engine_config = _checked_config(EngineArgs.create_engine_config)
    Scheduler.__init__ = _installing(Scheduler.__init__, _install_scheduler)
    GPUModelRunner.__init__ = _installing(GPUModelRunner.__init__, _install_runner)


def _checked_config(create):
    @functools.wraps(create)
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        settings = _settings_of(config)
        if settings is not None:  # refused in the caller's process, before any engine starts
            from foresight.integrations.vllm.checks import adapt, check_config

            check_config(config, settings)
            adapt(config)
        return config
    return create_engine_config


def _installing(init, install):
    """``init`` (a vLLM class's ``__init__(self, vllm_config, ...)``) followed by ``install(self, vllm_config,
    settings)`` when the config enables the plugin."""
    @functools.wraps(init)
    def __init__(self, vllm_config, *args, **kwargs):
        init(self, vllm_config, *args, **kwargs)
        settings = _settings_of(vllm_config)
        if settings is not None:
            install(self, vllm_config, settings)
    return __init__


def _install_scheduler(scheduler, vllm_config, settings) -> None:
    from foresight.integrations.vllm import scheduler as scheduler_side
    from foresight.integrations.vllm.checks import check_config

    check_config(vllm_config, settings)  # again in the engine's process: launchers that bypass EngineArgs
    scheduler_side.install(scheduler, settings)


def _install_runner(runner, vllm_config, settings) -> None:
    from foresight.integrations.vllm import worker
    from foresight.integrations.vllm.checks import adapt

    adapt(vllm_config)  # before the runner compiles and captures (launchers that bypass EngineArgs)
    worker.install(runner, settings)
