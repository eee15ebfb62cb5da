"""foresight.engine.cache.rope_shift: a post-RoPE query rotated by Δ is the model's own query at position + Δ."""

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from foresight.engine.cache import rope_shift


def _check(model, config, dtype=torch.float32):
    x = torch.randn(2, 4, 5, config.head_dim)
    pos = torch.tensor([[3, 7, 100, 5, 0], [900, 1, 2, 3, 4]])
    shifts = (16, 32, 128, 1000)
    tables = rope_shift.shift_tables(config, shifts)
    cos, sin = model.model.rotary_emb(x, pos)
    q, _ = apply_rotary_pos_emb(x, x, cos, sin)
    for s, table in zip(shifts, tables):
        cos, sin = model.model.rotary_emb(x, pos + s)
        want, _ = apply_rotary_pos_emb(x, x, cos, sin)
        got = rope_shift.rotate(q.to(dtype), table)
        assert got.dtype == dtype
        assert torch.allclose(got.float(), want, atol=1e-4 if dtype == torch.float32 else 0.1), s


def test_default_rope_qwen3():
    cfg = Qwen3Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rope_theta=1e6)
    _check(Qwen3ForCausalLM(cfg), cfg)
    _check(Qwen3ForCausalLM(cfg), cfg, torch.bfloat16)


def test_scaled_rope_llama3_type():
    """A scaled type (Llama 3's) takes transformers' own frequencies; its attention factor is not a rotation."""
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, rope_theta=5e5, max_position_embeddings=4096,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    assert rope_shift.rope_parameters(cfg)["rope_type"] == "llama3"
    _check(LlamaForCausalLM(cfg), cfg)


def test_a_shift_of_zero_changes_nothing_and_a_model_without_rope_is_refused():
    cfg = Qwen3Config(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=16)
    x = torch.randn(3, 16)
    assert torch.allclose(rope_shift.rotate(x, rope_shift.shift_tables(cfg, (0,))[0]), x)
    with pytest.raises(ValueError, match="RoPE"):
        rope_shift.inverse_frequencies(GPT2Config(n_embd=64, n_head=4))
