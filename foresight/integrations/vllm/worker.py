"""The plugin's worker side: vLLM's model runner with each request's cache bounded by a foresight policy.

Installed on one runner instance (:func:`install`), it changes three things:

* every attention layer's ``impl.forward`` keeps the step's queries (after RoPE) for the statistics;
* ``_prepare_inputs``: RoPE positions stay logical, the slots written and the sequence lengths the kernel reads become
  physical (logical less the pairs evicted so far, :class:`~foresight.integrations.vllm.settings.Schedule`);
* ``execute_model``: after the forward, each request's queries go to its
  :class:`~foresight.integrations.vllm.request.PagedRequest`; where the schedule has an eviction, the kept pairs are
  compacted into the request's first positions and its block-table row is cut to the blocks they fill. The scheduler
  frees the same tail blocks at its next step (:mod:`foresight.integrations.vllm.scheduler`).
"""

from __future__ import annotations

import re
import time
import types
from pathlib import Path

import numpy as np
import torch

from foresight.engine.attention_shape import AttentionShape
from foresight.integrations.vllm.layouts import PagedKV, layout_for
from foresight.integrations.vllm.request import PagedRequest
from foresight.integrations.vllm.settings import PluginConfigError, PluginSettings, Schedule
from foresight.runtime import atomic

_LAYER = re.compile(r"layers\.(\d+)\.")


def build_policy(settings: PluginSettings, hf_config, device):
    """The policy the plugin evicts with: the scorer checkpoint's (checked against the served model) or a heuristic."""
    if settings.policy:
        from foresight.policies import make_policy

        return make_policy(settings.policy)
    from foresight.integrations.vllm.checks import check_checkpoint
    from foresight.scorers.checkpoint import load_scorer, policy_from_checkpoint

    check_checkpoint(settings.scorer, hf_config)
    bank, cfg = load_scorer(settings.scorer, device=device)
    policy = policy_from_checkpoint(bank, cfg, precision=settings.scorer_precision)
    if hasattr(policy, "observe"):
        raise PluginConfigError(f"foresight plugin: {settings.scorer} holds a stateful scorer (it observes every pair "
                                "as it is written), which the plugin does not run")
    return policy


class WorkerPlugin:
    """The eviction state of one model runner: the policy, the paged layout, every running request's state."""

    def __init__(self, runner, settings: PluginSettings):
        self.runner, self.settings = runner, settings
        self.hf_config = runner.vllm_config.model_config.hf_config
        self.shape = AttentionShape.of(self.hf_config)
        self.policy = build_policy(settings, self.hf_config, runner.device)
        self.requests: dict[str, PagedRequest] = {}
        self.layers = None  # attention modules in layer order, bound at the first step
        self.queries: list = []
        self.step: list = []  # (request id, batch row, first token, tokens, computed before) of the step in progress
        self.active = False
        self.stats = {"steps": 0, "seconds": 0.0, "evictions": 0, "eviction_seconds": 0.0}  # the plugin's own work

    # ---------------------------------------------------------------------------------------------- set-up
    def bind(self) -> None:
        """The attention layers, their caches and the layout, once the model and its KV cache exist."""
        context = self.runner.vllm_config.compilation_config.static_forward_context
        found = {}
        for name, module in context.items():
            m = _LAYER.search(name)
            if m is not None and hasattr(module, "impl") and hasattr(module, "kv_cache"):
                found[int(m.group(1))] = module
        if sorted(found) != list(range(self.shape.num_layers)):
            raise PluginConfigError(f"foresight plugin: found attention layers {sorted(found)}, expected "
                                    f"{self.shape.num_layers} (a model whose layers are not all full attention)")
        self.layers = [found[i] for i in range(self.shape.num_layers)]
        first = self.layers[0]
        self.block_size = self.runner.cache_config.block_size
        self.layout = layout_for(first.attn_backend.get_name(), getattr(first, "isa", None), self.block_size,
                                 self.shape.head_dim)
        self.scaling = float(first.impl.scale)
        for i, module in enumerate(self.layers):
            module.impl.forward = self._recording(module.impl.forward, i)

    def _recording(self, forward, index: int):
        def recording_forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            if self.active and attn_metadata is not None:
                t = attn_metadata.num_actual_tokens
                self.queries[index] = query[:t].reshape(t, -1, self.shape.head_dim).clone()
            return forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        return recording_forward

    def state(self, req_id: str, prompt_len: int) -> PagedRequest:
        st = self.requests.get(req_id)
        if st is None:
            like = self.layers[0].kv_cache
            st = self.requests[req_id] = PagedRequest(
                self.shape, self.policy, self.settings.eviction, Schedule.of(self.settings.eviction, prompt_len),
                self.scaling, torch.empty(0, dtype=self.runner.model_config.dtype, device=like.device))
        return st

    # ------------------------------------------------------------------------------------------------- steps
    def prepare_inputs(self, original, scheduler_output, num_scheduled_tokens):
        out = original(scheduler_output, num_scheduled_tokens)
        runner, ib = self.runner, self.runner.input_batch
        num_reqs = ib.num_reqs
        computed = ib.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        offsets = np.zeros(num_reqs, dtype=np.int64)
        self.step, start = [], 0
        for i, req_id in enumerate(ib.req_ids[:num_reqs]):
            st = self.state(req_id, int(ib.num_prompt_tokens[i]))
            offsets[i] = st.schedule.dropped(int(computed[i]))
            count = int(num_scheduled_tokens[i])
            self.step.append((req_id, i, start, count, int(computed[i])))
            start += count
        if offsets.any():  # physical lengths and slots; RoPE positions stay logical
            off = torch.from_numpy(offsets)
            runner.seq_lens[:num_reqs] -= off.to(runner.seq_lens.device, runner.seq_lens.dtype)
            runner.optimistic_seq_lens_cpu[:num_reqs] -= off.to(runner.optimistic_seq_lens_cpu.dtype)
            per_token = torch.from_numpy(np.repeat(offsets, num_scheduled_tokens[:num_reqs]))
            physical = runner.positions[:start] - per_token.to(runner.positions.device, runner.positions.dtype)
            ib.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[:num_reqs + 1], physical)
        return out

    def execute_model(self, original, scheduler_output, *args, **kwargs):
        if self.layers is None:
            self.bind()
        for req_id in scheduler_output.finished_req_ids:
            self.finish(req_id)
        for req_id in getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ():
            self.requests.pop(req_id, None)  # recomputed from its tokens (never evicted: the scheduler refuses those)
        self.queries, self.step, self.active = [None] * self.shape.num_layers, [], True
        try:
            out = original(scheduler_output, *args, **kwargs)
        finally:
            self.active = False
        if self.step:
            missing = [i for i, q in enumerate(self.queries) if q is None]
            if missing:
                raise RuntimeError(f"foresight plugin: the attention of layers {missing} did not run through the "
                                   "recorded backend this step, so their statistics would be missing")
            self.after_forward()
        self.queries = []
        return out

    def after_forward(self) -> None:
        start = time.perf_counter()
        queries = torch.stack(self.queries)  # [nl, T, Hq, d]
        tables = self.runner.input_batch.block_table[0]
        for req_id, row, begin, count, computed in self.step:
            st = self.requests[req_id]
            held = int(tables.num_blocks_per_row[row])
            block_ids = torch.from_numpy(tables.block_table.np[row, :held].astype(np.int64)).to(queries.device)
            steps, began = st.steps, time.perf_counter()
            st.feed(queries[:, begin:begin + count].transpose(1, 2), PagedKV(self.layout, self.caches(), block_ids))
            expected = st.schedule.physical(computed + count)
            if st.n != expected:
                raise RuntimeError(f"foresight plugin: request {req_id} holds {st.n} pairs per head, its schedule "
                                   f"says {expected} (the scheduler and the worker disagree)")
            if st.steps != steps:
                self.stats["evictions"] += 1
                self.stats["eviction_seconds"] += time.perf_counter() - began
                self.cut_blocks(req_id, row, -(-st.n // self.block_size))
                if self.settings.record is not None:
                    self.record(req_id, st)
        self.stats["steps"] += 1
        self.stats["seconds"] += time.perf_counter() - start

    def caches(self) -> list:
        return [m.kv_cache for m in self.layers]

    def cut_blocks(self, req_id: str, row: int, keep: int) -> None:
        """Cut a request's block-table row (and its cached block ids) to its first ``keep`` blocks; the scheduler
        frees the rest at its next step."""
        table = self.runner.input_batch.block_table[0]
        held = int(table.num_blocks_per_row[row])
        if held > keep:
            table.block_table.np[row, keep:held] = 0
            table.num_blocks_per_row[row] = keep
            del self.runner.requests[req_id].block_ids[0][keep:]

    def finish(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def record(self, req_id: str, st: PagedRequest) -> None:
        """``record/<request>/<step>.pt``: the token indices each (layer, KV head) keeps after eviction ``step``."""
        folder = Path(self.settings.record) / re.sub(r"[^A-Za-z0-9_.-]", "_", req_id)
        atomic.torch_save({"prompt_len": st.prompt_len, "seen": st.seen, "kept": st.token[:, 0, :, :st.n].clone()},
                          folder / f"{st.steps - 1:05d}.pt")


def install(runner, settings: PluginSettings) -> WorkerPlugin:
    """Bound every request's cache on ``runner`` (a vLLM ``GPUModelRunner`` or subclass) by ``settings``."""
    plugin = WorkerPlugin(runner, settings)
    prepare, execute = runner._prepare_inputs, runner.execute_model
    runner._prepare_inputs = types.MethodType(lambda _, *a: plugin.prepare_inputs(prepare, *a), runner)
    runner.execute_model = types.MethodType(lambda _, *a, **k: plugin.execute_model(execute, *a, **k), runner)
    runner.foresight = plugin
    return plugin
