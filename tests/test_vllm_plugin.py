"""The vLLM plugin's parts that need no vLLM (``foresight.integrations.vllm``): its settings, the eviction schedule
both of vLLM's processes derive, the paged KV layouts, its start-up refusals, and a request's eviction state fed with
the queries and pairs of a real model run, against the project's own cache on the same run. The plugin inside a
real vLLM: ``tests/vllm/test_plugin.py`` (``make test-vllm``)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from foresight.config.eviction import EvictionSettings
from foresight.engine.attention_shape import AttentionShape
from foresight.engine.cache.bounded import BoundedCache
from foresight.engine.rollout import rollout
from foresight.integrations.vllm import checks
from foresight.integrations.vllm.layouts import CpuLayout, FlashLayout, PagedKV, layout_for, slots_of
from foresight.integrations.vllm.request import PagedRequest
from foresight.integrations.vllm.settings import PluginConfigError, Schedule, resolve
from foresight.policies import make_policy
from foresight.scorers.bank import LearnedPolicy, ScorerBank
from tests.conftest import tiny_qwen3


# ------------------------------------------------------------------------------------------------------ settings
def test_the_plugin_is_inert_without_settings_and_reads_env_or_vllm_config():
    assert resolve({}, {}) is None
    env = resolve({}, {"FORESIGHT_VLLM_POLICY": "h2o", "FORESIGHT_VLLM_BUDGET": "64", "FORESIGHT_VLLM_INTERVAL": "16",
                       "FORESIGHT_VLLM_PROTECT_PROMPT": "true"})
    assert env.policy == "h2o" and (env.eviction.budget, env.eviction.interval, env.eviction.protect_prompt) == \
        (64, 16, True)
    ours = resolve({"foresight": {"scorer": "scorers/smollm2-135m/sft-w256-gap"}}, {"FORESIGHT_VLLM_POLICY": "tova"})
    assert ours.scorer and (ours.eviction.budget, ours.eviction.interval) == (256, 32)  # the checkpoint's B and L
    assert ours.scorer_precision == "float32"  # the trained scores exactly unless asked
    assert resolve({}, {"FORESIGHT_VLLM_SCORER": "scorers/smollm2-135m/sft-w256-gap",
                        "FORESIGHT_VLLM_SCORER_PRECISION": "bfloat16"}).scorer_precision == "bfloat16"
    assert resolve({}, {"FORESIGHT_VLLM_POLICY": "streamingllm", "FORESIGHT_VLLM_BUDGET": "64",
                        "FORESIGHT_VLLM_INTERVAL": "16"}).eviction.sinks == 4


@pytest.mark.parametrize("config, message", [
    ({"policy": "h2o", "budget": 64}, "interval is required"),
    ({"policy": "h2o", "budget": 16, "interval": 16}, "must be smaller than the budget"),
    ({"policy": "nope", "budget": 64, "interval": 16}, "unknown eviction policy"),
    ({"policy": "h2o", "scorer": "x", "budget": 64, "interval": 16}, "not both"),
    ({"budget": 64}, "without a scorer or a policy"),
    ({"policy": "h2o", "budget": "many", "interval": 16}, "budget must be an integer"),
    ({"policy": "h2o", "budget": 64, "interval": 16, "bugdet": 3}, "unknown keys"),
    ({"scorer": "scorers/smollm2-135m/sft-w256-gap", "scorer_precision": "int8"}, "scorer_precision must be one of"),
    ({"policy": "h2o", "budget": 64, "interval": 16, "scorer_precision": "bfloat16"}, "applies to a scorer checkpoint"),
])
def test_bad_settings_are_refused_in_one_line(config, message):
    with pytest.raises(PluginConfigError, match=message):
        resolve({"foresight": config}, {})


# ------------------------------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize("budget, interval, prompt, protect", [(16, 4, 10, False), (16, 4, 18, False),
                                                               (12, 4, 6, True), (16, 8, 20, True)])
def test_the_schedule_evicts_where_the_engine_does(budget, interval, prompt, protect):
    """The steps after which the plugin evicts are the token counts at which the project's cache evicted (prompts
    that fit the capacity; a longer one the plugin holds whole until it is complete)."""
    model = tiny_qwen3()
    settings = EvictionSettings(budget=budget, interval=interval, protect_prompt=protect, prompt_overflow="evict")
    steps = []
    rollout(model, torch.randint(3, 30, (1, 90), generator=torch.Generator().manual_seed(0)), make_policy("h2o"),
            settings, prompt_len=prompt, recorder=steps.append)
    sched = Schedule.of(settings, prompt)
    assert [s["seen"] for s in steps] == [c for c in range(1, 90) if sched.evicts_after(c)]
    held = {s["seen"]: s["token"].shape[-1] - s["chosen"].shape[-1] for s in steps}
    assert all(sched.physical(c) == n for c, n in held.items())


def test_a_prompt_longer_than_the_capacity_is_held_whole_then_evicted_to_the_target():
    sched = Schedule.of(EvictionSettings(budget=16, interval=4), 50)
    assert [c for c in range(1, 70) if sched.evicts_after(c)] == [50, 54, 58, 62, 66]
    assert sched.physical(49) == 49 and sched.physical(50) == 16 and sched.physical(53) == 19


# ------------------------------------------------------------------------------------------------------- layouts
def reference_cpu(nb, h, bs, d, slots, keys, values):
    """vLLM's CPU layout written by hand: per (block, head), keys transposed [d, bs], then values [bs, d]."""
    cache = torch.zeros(nb, h, bs, 2 * d)
    flat = cache.view(nb, h, 2 * bs * d)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, bs)
        for head in range(h):
            for j in range(d):
                flat[b, head, j * bs + o] = keys[head, i, j]
            flat[b, head, bs * d + o * d: bs * d + (o + 1) * d] = values[head, i]
    return cache


def test_paged_layouts_read_and_write_the_slots_of_a_block_table():
    nb, h, bs, d, n = 6, 2, 4, 8, 11
    block_ids = torch.tensor([3, 1, 5])  # any order; block 0 (vLLM's null block) unused
    slots = slots_of(block_ids, bs, n)
    assert slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 20, 21, 22]
    keys, values = torch.randn(h, n, d), torch.randn(h, n, d)
    cpu = reference_cpu(nb, h, bs, d, slots, keys, values)
    flash = torch.zeros(2, nb, bs, h, d)
    flash[0, slots // bs, slots % bs] = keys.transpose(0, 1)
    flash[1, slots // bs, slots % bs] = values.transpose(0, 1)
    for layout, cache in ((CpuLayout(bs, d), cpu), (FlashLayout(bs, d), flash)):
        k, v = layout.gather(cache, slots)
        assert torch.equal(k, keys) and torch.equal(v, values)
        before = cache.clone()
        paged = PagedKV(layout, [cache], block_ids)
        kv = paged.read(n)
        assert torch.equal(kv[0, 0, 0], keys) and torch.equal(kv[1, 0, 0], values)
        moved = torch.tensor([[10, 8, 5, 3, 9], [0, 1, 4, 6, 7]])  # per head: what positions 2..6 take
        paged.write_moved(kv[:, :, 0], moved[None], 2, 7)  # the rest untouched
        k2, v2 = layout.gather(cache, slots)
        for head in range(h):
            assert torch.equal(k2[head, 2:7], keys[head, moved[head]])
            assert torch.equal(v2[head, 2:7], values[head, moved[head]])
        assert torch.equal(k2[:, :2], keys[:, :2]) and torch.equal(k2[:, 7:], keys[:, 7:])
        assert torch.equal(v2[:, :2], values[:, :2]) and torch.equal(v2[:, 7:], values[:, 7:])
        null = (lambda c: c[:, 0]) if layout.name == "flash" else (lambda c: c[0])
        assert torch.equal(null(cache), null(before))  # the null block and every other block untouched
    assert isinstance(layout_for("CPU_ATTN", "vec", bs, d), CpuLayout)
    assert isinstance(layout_for("FLASH_ATTN", None, bs, d), FlashLayout)
    with pytest.raises(ValueError, match="amx"):
        layout_for("CPU_ATTN", "amx", bs, d)


# ------------------------------------------------------------------------------------------------------ refusals
def vllm_config(**changes):
    model = SimpleNamespace(dtype=torch.float32, get_sliding_window=lambda: changes.get("window"),
                            is_hybrid=changes.get("hybrid", False), hf_config=None)
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=changes.get("prefix", False),
                                     cache_dtype=changes.get("kv", "auto")),
        scheduler_config=SimpleNamespace(async_scheduling=changes.get("async_", False)),
        parallel_config=SimpleNamespace(pipeline_parallel_size=changes.get("pp", 1),
                                        tensor_parallel_size=changes.get("tp", 1)),
        speculative_config=changes.get("spec"), model_config=model)


@pytest.mark.parametrize("change, named", [({"prefix": True}, "prefix caching"), ({"async_": True}, "async"),
                                           ({"spec": object()}, "speculative"), ({"tp": 2}, "tensor"),
                                           ({"pp": 2}, "pipeline"), ({"kv": "fp8"}, "kv_cache_dtype=fp8"),
                                           ({"window": 4096}, "sliding-window")])
def test_settings_that_would_corrupt_an_evicted_cache_are_named(change, named):
    assert checks.refusals(vllm_config()) == [] and checks.refusals(vllm_config(kv="float32")) == []
    problems = checks.refusals(vllm_config(**change))
    assert len(problems) == 1 and named in problems[0]


def test_a_checkpoint_for_another_model_and_another_vllm_are_refused():
    smollm2 = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    checks.check_checkpoint("scorers/smollm2-135m/sft-w256-gap", smollm2)
    with pytest.raises(PluginConfigError, match="num_layers: checkpoint .* vs served model 30"):
        checks.check_checkpoint("scorers/tiny-qwen3/grpo", smollm2)
    with pytest.raises(PluginConfigError, match="built for vLLM 0.32.0.*found vLLM 0.33.1"):
        checks.check_version("0.33.1")
    checks.check_version("0.32.0+cpu")


# ----------------------------------------------------------------------------------------- a request's state
def captured_run(model, ids, policy, settings, prompt_len, monkeypatch):
    """The project's cache on ``ids`` (teacher-forced): its eviction steps, and per forward chunk the keys, values
    [nl, h, q, d] written and the queries [nl, Hq, q, d] attended (after RoPE)."""
    chunks, steps = [], []
    update, attend = BoundedCache.update, BoundedCache.attend

    def spy_update(self, k, v, layer, *a, **kw):
        if layer == 0:
            chunks.append({"k": [], "v": [], "q": []})
        chunks[-1]["k"].append(k[0].clone())
        chunks[-1]["v"].append(v[0].clone())
        return update(self, k, v, layer, *a, **kw)

    def spy_attend(self, layer, query, scaling):
        chunks[-1]["q"].append(query[0].clone())
        return attend(self, layer, query, scaling)

    monkeypatch.setattr(BoundedCache, "update", spy_update)
    monkeypatch.setattr(BoundedCache, "attend", spy_attend)
    rollout(model, ids, policy, settings, prompt_len=prompt_len, recorder=steps.append)
    monkeypatch.undo()
    return [{k: torch.stack(v) for k, v in c.items()} for c in chunks], steps


@pytest.mark.parametrize("policy_name", ["h2o", "tova", "snapkv", "learned", "learned-bfloat16"])
@pytest.mark.parametrize("protect", [False, True])
def test_a_paged_request_keeps_what_the_engine_keeps_and_compacts_it_in_place(policy_name, protect, monkeypatch):
    """Fed the same forward chunks' queries and pairs (written to a paged cache with a scattered block table), a
    request's state evicts at the same steps, keeps the same pairs of every (layer, KV head) bit for bit, and leaves
    exactly their keys and values in its first physical positions (vLLM's CUDA layout, and its CPU layout with the
    prompt protected)."""
    model = tiny_qwen3(layers=3)
    shape = AttentionShape.of(model.config)
    policy = make_policy(policy_name) if not policy_name.startswith("learned") else \
        LearnedPolicy(ScorerBank(3, 2, 16, 2, hidden=8, seed=3), precision=policy_name.partition("-")[2] or "float32")
    settings = EvictionSettings(budget=16, interval=4, protect_prompt=protect, prompt_overflow="evict")
    ids = torch.randint(3, 30, (1, 70), generator=torch.Generator().manual_seed(1))
    chunks, steps = captured_run(model, ids, policy, settings, 9, monkeypatch)
    bs, layout = 4, (CpuLayout if protect else FlashLayout)(4, shape.head_dim)
    size = (40, shape.kv_heads, bs, 2 * shape.head_dim) if protect else (2, 40, bs, shape.kv_heads, shape.head_dim)
    caches = [torch.zeros(size) for _ in range(shape.num_layers)]
    block_ids = torch.randperm(39, generator=torch.Generator().manual_seed(2))[:20] + 1
    req = PagedRequest(shape, policy, settings, Schedule.of(settings, 9), model.config.head_dim ** -0.5, ids.float())
    key_of, kept, fed = {}, [], 0
    for c in chunks:
        q = c["k"].shape[2]
        paged = PagedKV(layout, caches, block_ids)
        for layer, cache in enumerate(caches):  # what vLLM's forward writes: the chunk's pairs after the kept ones
            layout.scatter(cache, slots_of(block_ids, bs, req.n + q, req.n), c["k"][layer], c["v"][layer])
        for t in range(q):
            key_of[fed + t] = c["k"][:, :, t]
        before = req.steps
        req.feed(c["q"], paged)
        fed += q
        assert req.n == req.schedule.physical(fed)
        if req.steps != before:
            kept.append(req.token[:, 0, :, :req.n].clone())
            keys = paged.read(req.n)[0]
            for layer in range(shape.num_layers):
                for head in range(shape.kv_heads):
                    want = torch.stack([key_of[int(t)][layer, head] for t in req.token[layer, 0, head, :req.n]])
                    assert torch.equal(keys[layer, 0, head], want)
    assert len(kept) == len(steps) >= 8
    for step, mine in zip(steps, kept):
        tok = step["token"][:, 0]
        drop = torch.zeros_like(tok, dtype=torch.bool).scatter_(-1, step["chosen"][:, 0], True)
        theirs = tok.masked_fill(drop, -1).sort(-1).values[..., drop.shape[-1] - mine.shape[-1]:]
        assert torch.equal(theirs, mine.sort(-1).values)
