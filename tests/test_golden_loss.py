"""Golden pooling ``loss`` (foresight.targets.golden_loss): first-order loss costs of evicting each pair."""

import pytest
import torch

from conftest import tiny_qwen3
from foresight.engine.attention import pooling, use_foresight_attention
from foresight.config.eviction import EvictionSettings
from foresight.targets.golden import GoldenPolicy, block_pooled_attention
from foresight.targets.golden_loss import loss_pooled_cost
from foresight.engine.rollout import rollout
from foresight.engine.cache.slot_attention import causal_block

B, L, S = 16, 8, 40


class Perturbed:
    """Dense float64 attention in which, at one layer, the queries of block ``u`` of KV head ``h``'s group move
    ``d`` of the way towards having dropped key ``j`` (its probability to 0, the rest renormalised)."""

    def __init__(self, layer, h, u, j, d):
        self.layer, self.h, self.u, self.j, self.d = layer, h, u, j, d

    def attend(self, layer_idx, q, k, v, scale):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        p = ((q @ k.transpose(-1, -2)) * scale - causal_block(q.shape[2], q.device).double()).softmax(-1)
        if layer_idx == self.layer:
            p = p.clone()
            rows = slice(B + self.u * L, B + (self.u + 1) * L)
            for head in range(self.h * g, (self.h + 1) * g):
                blk = p[0, head, rows]
                pj = blk[:, self.j:self.j + 1]
                delta = blk * pj / (1 - pj)
                delta[:, self.j] = -pj[:, 0]
                p[0, head, rows] = blk + self.d * delta
        return (p @ v).transpose(1, 2)


def summed_nll(model, ids, tap) -> float:
    with torch.no_grad(), pooling(tap):
        logits = model(ids, use_cache=False).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()


@pytest.fixture
def model64():
    torch.manual_seed(0)
    return use_foresight_attention(tiny_qwen3().double())


def test_block_cost_is_the_first_order_loss_change_of_dropping_the_key(model64):
    """Signed: Σ over the group's heads and the block's queries of −∂ℒ/∂s / (1 − p) equals the derivative of the
    summed NLL along the drop of that key for those queries (central differences; the model's RMSNorm rounds to fp32,
    so the step is 1e-3)."""
    ids = torch.randint(8, 170, (1, S))
    costs = loss_pooled_cost(model64, ids, [S], B, L, magnitude=False).a
    d = 1e-3
    for layer, h, u, j in [(0, 0, 0, 3), (1, 1, 1, 10), (1, 0, 2, 0), (0, 1, 2, 25)]:
        fd = (summed_nll(model64, ids, Perturbed(layer, h, u, j, d))
              - summed_nll(model64, ids, Perturbed(layer, h, u, j, -d))) / (2 * d)
        assert costs[layer, 0, u, h, j].item() == pytest.approx(fd, rel=0.02, abs=1e-5), (layer, h, u, j)
    # keys after a block's queries cost it nothing (causality); the padding past the block rows stays zero
    assert costs[:, 0, 0, :, B + L:].abs().max() == 0


def test_magnitude_pooling_and_future_over_padded_rows(model64):
    torch.manual_seed(1)
    ids = torch.randint(8, 170, (2, S))
    signed = loss_pooled_cost(model64, ids, [S, 35], B, L, magnitude=False)
    mag = loss_pooled_cost(model64, ids, [S, 35], B, L)
    assert (mag.a >= signed.a.abs() - 1e-7).all()  # Σ|c| >= |Σc|
    assert (mag.a > signed.a.abs() + 1e-6).any()  # and the magnitude is taken per head and query
    alone = loss_pooled_cost(model64, ids[1:, :35], [35], B, L)  # a padded row = the trace alone
    assert torch.allclose(mag.future(1), alone.future(0), atol=1e-6)
    f, a = mag.future(0), mag.a[:, 0]  # 3 blocks; F_t = max over the blocks after t (BlockPooler's)
    assert f.shape[1] == 3
    assert torch.equal(f[:, 0], torch.maximum(a[:, 1], a[:, 2])) and torch.equal(f[:, 1], a[:, 2])
    assert f[:, 2].abs().max() == 0


def test_loss_pooling_drives_golden_eviction():
    torch.manual_seed(2)
    model = use_foresight_attention(tiny_qwen3())
    ids = torch.randint(8, 170, (1, 56))
    st = EvictionSettings(budget=16, interval=8)
    future = block_pooled_attention(model, ids, st, pool="loss").future()
    assert future.shape[1] == -(-(56 - 16) // 8) and future.abs().sum() > 0
    res = rollout(model, ids, GoldenPolicy(future), st)
    assert res.held_per_row.max() <= 16 + 8 and torch.isfinite(res.token_loss).all()


def test_loss_pooling_needs_the_foresight_attention():
    model = tiny_qwen3()
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="foresight"):
        loss_pooled_cost(model, torch.randint(8, 170, (1, 30)), [30], 8, 4)
