"""Shared fixtures: tiny random models built from real transformers configs (Qwen3, Llama), saved with the
project's tokenizer so every stage can load them like any checkpoint."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from data_prep import ledger
from data_prep.tokenizer import build_tokenizer
from foresight.engine.attention import use_foresight_attention

torch.set_num_threads(2)


@pytest.fixture(autouse=True, scope="session")
def _reference_cache(tmp_path_factory):
    """Evaluation's reference-trace cache in a folder of the test session, never the user's."""
    import os

    old = os.environ.get("FORESIGHT_CACHE")
    os.environ["FORESIGHT_CACHE"] = str(tmp_path_factory.mktemp("foresight-cache"))
    yield
    if old is None:
        os.environ.pop("FORESIGHT_CACHE", None)
    else:
        os.environ["FORESIGHT_CACHE"] = old


def tiny_qwen3(seed: int = 0, layers: int = 2, kv_heads: int = 2, heads: int = 4, head_dim: int = 16):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(ledger.VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, bos_token_id=ledger.BOS, eos_token_id=ledger.EOS,
                      pad_token_id=ledger.PAD, tie_word_embeddings=True)
    return use_foresight_attention(Qwen3ForCausalLM(cfg).eval())


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(ledger.VOCAB), hidden_size=72, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=ledger.BOS, eos_token_id=ledger.EOS, pad_token_id=ledger.PAD)
    return use_foresight_attention(LlamaForCausalLM(cfg).eval())


def feed_chunks(model, cache, ids):
    outs, s = [], 0
    while s < ids.shape[1]:
        q = cache.next_chunk(ids.shape[1] - s)
        outs.append(model(input_ids=ids[:, s:s + q], cache=cache, use_cache=True).logits)
        s += q
    return torch.cat(outs, 1)


def eager_attentions(model, ids):
    """Dense attention probabilities of a tiny Qwen3 (per layer [b, Hq, S, S]) from transformers' eager path."""
    eager = tiny_qwen3()
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        return eager(ids, output_attentions=True).attentions


class Killed(Exception):
    pass


@contextlib.contextmanager
def killed_after_checkpoint():
    """Within the block, ``foresight.runtime.atomic.torch_save`` (the training checkpoints' writer) raises right after writing
    a checkpoint (a job killed there)."""
    from foresight.runtime import atomic

    orig = atomic.torch_save

    def save_then_kill(obj, path):
        orig(obj, path)
        raise Killed()

    atomic.torch_save = save_then_kill
    try:
        with pytest.raises(Killed):
            yield
    finally:
        atomic.torch_save = orig


@pytest.fixture
def qwen3():
    return tiny_qwen3()


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A tiny random Qwen3 saved with the ledger tokenizer (a loadable model folder)."""
    m = tiny_qwen3()
    d = tmp_path / "tiny-random-qwen3"
    m.save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    return d


# a tiny SFT run on the tiny random teacher's traces (tests/test_sft*.py)
SFT_SETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=6",
            "traces.batch_size=3", "traces.require_correct=false", "traces.min_new_tokens=5", "traces.max_new_tokens=24",
            "cache.budget=12", "cache.interval=4", "sft.steps=6", "sft.batch_traces=2", "sft.ckpt_every=3", "sft.warmup=2"]


@pytest.fixture
def sft_setup(tiny_model_dir, tmp_path):
    """A recipe of SFT_SETS on the tiny model, and the traces it writes."""
    from foresight.config.recipe import load_recipe
    from foresight.data import traces

    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SFT_SETS])
    tdir = tmp_path / "traces"
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)
    return r, tdir
