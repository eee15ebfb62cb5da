"""The vLLM plugin served by ``vllm serve`` (its settings from ``--additional-config``), the CUDA graph modes it adapts,
and the CPU paged layout it reads against vLLM's own cache op."""

import json
import urllib.request
from types import SimpleNamespace

import torch

from foresight.config.eviction import EvictionSettings
from tests.vllm.conftest import vllm_server
from tests.vllm.test_plugin import SCORER, compare_kept, engine_steps, policy_of


def test_vllm_serve_takes_the_plugin_from_its_additional_config(exported, prompts, engine, tmp_path):
    """``vllm serve --additional-config '{"foresight": ...}'`` (vLLM's own processes, its OpenAI API): the request's
    kept sets are the engine's on the tokens the server returned."""
    cfg = {"scorer": SCORER, "budget": 64, "interval": 16}
    record = tmp_path / "record"
    extra = ("--additional-config", json.dumps({"foresight": {**cfg, "record": str(record)}}))
    server = vllm_server(exported, tmp_path / "server.log", extra=extra).start()
    try:
        body = {"model": str(exported), "prompt": prompts[1], "max_tokens": 160, "min_tokens": 160, "temperature": 0,
                "return_token_ids": True}
        req = urllib.request.Request(server.url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        toks = json.loads(urllib.request.urlopen(req, timeout=600).read())["choices"][0]["token_ids"]
    finally:
        server.kill()
    (folder,) = record.iterdir()
    kept = [torch.load(f)["kept"] for f in sorted(folder.iterdir())]
    assert len(toks) == 160 and len(kept) >= 5
    model = engine[0]
    settings = EvictionSettings(budget=64, interval=16, prompt_overflow="evict")
    equal, total, bad = compare_kept(engine_steps(model, prompts[1] + toks, policy_of(cfg, model), settings,
                                                  len(prompts[1])), kept)
    assert not bad and equal >= 0.97 * total, (equal, total, bad[:3])


def test_cuda_graphs_that_capture_attention_become_piecewise():
    """vLLM's GPU default (FULL_AND_PIECEWISE) would replay attention without the plugin's recording wrapper."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode as M

    from foresight.integrations.vllm.checks import adapt

    for mode, want in ((M.FULL_AND_PIECEWISE, M.PIECEWISE), (M.FULL_DECODE_ONLY, M.NONE), (M.FULL, M.NONE),
                       (M.PIECEWISE, M.PIECEWISE), (M.NONE, M.NONE)):
        config = SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=mode))
        adapt(config)
        assert config.compilation_config.cudagraph_mode == want, mode


def test_the_cpu_layout_reads_and_writes_what_vllms_own_cache_op_writes():
    from vllm import _custom_ops as ops

    from foresight.integrations.vllm.layouts import CpuLayout, slots_of

    nb, h, bs, d, n = 5, 3, 32, 64, 70
    block_ids = torch.tensor([4, 2, 3])
    slots = slots_of(block_ids, bs, n)
    keys, values = torch.randn(n, h, d), torch.randn(n, h, d)
    for isa in ("vec", "vec16"):
        cache = torch.zeros(nb, h, bs, 2 * d)
        kc, vc = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, slots, isa)
        k, v = CpuLayout(bs, d).gather(cache, slots)
        assert torch.equal(k, keys.transpose(0, 1)) and torch.equal(v, values.transpose(0, 1))
        mine = torch.zeros_like(cache)
        CpuLayout(bs, d).scatter(mine, slots, keys.transpose(0, 1), values.transpose(0, 1))
        assert torch.equal(mine, cache)
