"""The preallocated full cache (foresight.engine.cache.full): buffers allocated once, attention over the filled part only,
values those of transformers' DynamicCache."""

import pytest
import torch
from transformers import DynamicCache

from foresight.engine.cache.full import PreallocatedCache
from foresight.engine.generate import generate


def _keys_seen(model, monkeypatch):
    """Record the key length every attention call of ``model`` reads."""
    import foresight.engine.attention as attention

    seen = []
    real = attention.sdpa_attention_forward

    def spy(module, query, key, value, mask, **kw):
        seen.append(key.shape[-2])
        return real(module, query, key, value, mask, **kw)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    return seen


def test_decoding_reads_the_filled_prefix_only_and_equals_the_dynamic_cache(qwen3, monkeypatch):
    ids = torch.randint(8, 170, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    seen = _keys_seen(qwen3, monkeypatch)
    out = generate(qwen3, ids, mask, max_new_tokens=20)
    layers = qwen3.config.num_hidden_layers
    # prefill: 10 keys; then step t reads 10 + t keys, never the capacity of 30 (a StaticCache reads 30 every time)
    assert seen == [n for n in range(10, 30) for _ in range(layers)]
    assert isinstance(out.cache, PreallocatedCache)
    layer = out.cache.layers[0]
    assert layer._k.shape[-2] == 30 and layer.keys.data_ptr() == layer._k.data_ptr()  # a view of the one buffer
    monkeypatch.undo()
    ref = qwen3.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)  # DynamicCache
    assert torch.equal(out.sequences, ref)


def test_chunks_with_padding_equal_the_dynamic_cache_bit_for_bit(qwen3):
    """The same keys in the same order reach the same SDPA call, so the logits are DynamicCache's exactly (a
    StaticCache's attention also sums over its empty slots: in bfloat16 SmolLM2's prefill logits moved by up to 0.6)."""
    from foresight.engine.rollout import Chunking, forward_chunks

    ids = torch.randint(8, 170, (2, 24))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :5] = False
    logits = {}
    for name, cache in (("pre", PreallocatedCache(qwen3.config, 40)), ("dyn", DynamicCache())):
        with torch.no_grad():
            logits[name] = torch.cat([lg for _, _, lg in forward_chunks(qwen3, cache, ids, mask, Chunking(8))], 1)
        assert cache.get_seq_length() == 24
    assert torch.equal(logits["pre"], logits["dyn"])


def test_overflow_names_the_capacity(qwen3):
    cache = PreallocatedCache(qwen3.config, 8)
    with pytest.raises(ValueError, match="holds 8 tokens; 12 were fed"):
        with torch.no_grad():
            qwen3(input_ids=torch.randint(8, 170, (1, 12)), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="positive capacity"):
        PreallocatedCache(qwen3.config, 0)


def test_a_replaced_batch_is_adopted_by_the_next_update(qwen3):
    """DynamicLayer's batch selection replaces ``keys`` with a new tensor: the next update copies them into fresh
    buffers instead of writing past them into the old ones."""
    ids = torch.randint(8, 170, (3, 12))
    cache, ref = PreallocatedCache(qwen3.config, 16), DynamicCache()
    with torch.no_grad():
        for c in (cache, ref):
            qwen3(input_ids=ids[:, :8], cache=c, use_cache=True)
            c.batch_select_indices(torch.tensor([0, 2]))
        nxt = ids[[0, 2], 8:]
        pos = torch.arange(8, 12).expand(2, -1)
        a = qwen3(input_ids=nxt, position_ids=pos, cache=cache, use_cache=True).logits
        b = qwen3(input_ids=nxt, position_ids=pos, cache=ref, use_cache=True).logits
    assert cache.layers[0]._k.shape[0] == 2 and cache.get_seq_length() == 12
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_cache_goes_by_the_keyword_the_models_forward_takes(qwen3):
    from foresight.engine.cache_keyword import _cache_keyword, cache_kwargs

    class Older(torch.nn.Module):  # a transformers release before the rename: past_key_values only
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    assert _cache_keyword(Older) == "past_key_values"
    ids = torch.tensor([[3, 9, 4, 7, 1]])
    cache = DynamicCache(config=qwen3.config)
    qwen3(input_ids=ids[:, :4], use_cache=True, **cache_kwargs(qwen3, cache))
    step = qwen3(input_ids=ids[:, 4:], use_cache=True, **cache_kwargs(qwen3, cache)).logits[:, -1]
    assert cache.get_seq_length() == 5  # the model took the cache: both calls were appended to it
    torch.testing.assert_close(step, qwen3(input_ids=ids).logits[:, -1], rtol=1e-5, atol=1e-5)
