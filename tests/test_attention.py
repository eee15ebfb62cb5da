import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import tiny_qwen3
from foresight.engine.attention import foresight_attention


def prefix_logits_change(model, ids):
    with torch.no_grad():
        a = model(ids).logits[:, :10]
        ids2 = ids.clone()
        ids2[:, 10:] = (ids2[:, 10:] + 7) % 160 + 8
        b = model(ids2).logits[:, :10]
    return (a - b).abs().max().item()


def padding_error(model):
    """Max logit difference between a left-padded row and the same tokens unpadded."""
    x = torch.randint(8, 170, (1, 12))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = model(padded, attention_mask=mask, position_ids=pos).logits[:, 4:]
        b = model(x).logits
    return (a - b).abs().max().item()


def test_registered_mask_keeps_causality_and_padding_without_our_cache():
    m = tiny_qwen3()  # attention "foresight", no BoundedCache: SDPA with the registered mask function
    assert prefix_logits_change(m, torch.randint(8, 170, (1, 20))) < 1e-6
    assert padding_error(m) < 1e-5


def test_attention_registered_without_mask_function_gets_no_mask():
    """The pitfall the mask registration avoids: transformers builds no mask for an unknown attention name."""
    seen = []

    def spy(module, q, k, v, mask, **kw):
        seen.append(mask)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("spy-no-mask", spy)
    m = tiny_qwen3()
    m.set_attn_implementation("spy-no-mask")
    assert padding_error(m) > 1e-3  # padding is silently ignored
    assert all(x is None for x in seen)
    AttentionInterface.register("foresight-no-mask", foresight_attention)
    m.set_attn_implementation("foresight-no-mask")
    assert padding_error(m) > 1e-3
