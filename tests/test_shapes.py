from conftest import tiny_llama, tiny_qwen3
from foresight.engine.attention_shape import AttentionShape


def test_attention_shape_of_qwen3_and_llama_configs():
    q = AttentionShape.of(tiny_qwen3(kv_heads=2, heads=4, head_dim=16).config)
    assert (q.num_layers, q.q_heads, q.kv_heads, q.head_dim, q.group) == (2, 4, 2, 16, 2)
    ll = AttentionShape.of(tiny_llama().config)  # no head_dim field: hidden / heads
    assert (ll.q_heads, ll.kv_heads, ll.head_dim, ll.group) == (6, 2, 12, 3)
