"""The scorer bank's arithmetic: the fast path (a batched product written out instead of an einsum) must give
the scores and gradients of the plain formulation bit for bit, so that no kept set of a trained scorer moves."""

import dataclasses

import pytest
import torch
from torch import nn

from foresight.scorers.bank import ACTIVATIONS, ScorerBank


def einsum_reference(bank: ScorerBank, layers: slice, x: torch.Tensor) -> torch.Tensor:
    x = nn.functional.layer_norm(x.float(), (bank.d_in,))
    x = x * bank.ln_w[layers, None, :, None, :] + bank.ln_b[layers, None, :, None, :]
    hdn = torch.einsum("lbhnd,lhdk->lbhnk", x, bank.w1[layers]) + bank.b1[layers, None, :, None, :]
    return torch.einsum("lbhnk,lhk->lbhn", ACTIVATIONS[bank.activation](hdn), bank.w2[layers])


@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("batch,layers", [(1, slice(None)), (2, slice(1, 3)), (8, slice(0, 1))])
def test_forward_layers_is_bit_identical_to_the_einsum_formulation(activation, batch, layers):
    bank = ScorerBank(4, 3, 16, 3, hidden=16, activation=activation, seed=1)
    with torch.no_grad():
        for p in bank.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    nl = len(range(4)[layers])
    x = torch.randn(nl, batch, 3, 57, bank.d_in, generator=torch.Generator().manual_seed(batch))
    grads = []
    for fn in (einsum_reference, ScorerBank.forward_layers):
        xg = x.clone().requires_grad_()
        out = fn(bank, layers, xg)
        out.square().sum().backward()
        grads.append((out.detach(), xg.grad, *(p.grad.clone() for p in bank.parameters())))
        bank.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("layers", [slice(None), slice(1, 3)])
def test_the_folded_first_product_is_the_same_function_with_half_the_backward_products(layers):
    """``folded=True`` (SFT): the layer norm's scale and shift folded into the first product give the same scores and
    parameter gradients up to rounding, and the backward's batched products count half the floating-point operations
    (the weights' gradient only, not the normalised inputs' as well)."""
    from torch.utils.flop_counter import FlopCounterMode

    bank = ScorerBank(4, 3, 16, 3, hidden=32, activation="gelu", seed=1)
    with torch.no_grad():
        for p in bank.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x = torch.randn(len(range(4)[layers]), 2, 3, 57, bank.d_in, generator=torch.Generator().manual_seed(0))
    res = []
    for folded in (False, True):
        out = bank(x, layers=layers, folded=folded)
        with FlopCounterMode(display=False) as flops:
            out.square().sum().backward()
        res.append((out.detach(), [p.grad.clone() for p in bank.parameters()], flops.get_total_flops()))
        bank.zero_grad()
    (plain, plain_grads, plain_flops), (fold, fold_grads, fold_flops) = res
    torch.testing.assert_close(fold, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(fold_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    first = x.shape[0] * 3 * 2 * 57 * bank.d_in * 32 * 2  # one first product: rows × D_in × hidden, 2 flops each
    assert plain_flops > 2 * first and fold_flops < 1.1 * first  # the normalised inputs' gradient is gone


def hand_view(seen: int = 40, nl: int = 3, b: int = 2, h: int = 2, g: int = 2, n: int = 9, d: int = 8):
    """An eviction view with random keys, values and statistics, its slots holding scattered token indices."""
    from foresight.engine.features import STAT_NAMES
    from foresight.engine.view import EvictionView

    gen = torch.Generator().manual_seed(seen)
    token = torch.sort(torch.randperm(seen, generator=gen)[:n]).values.expand(nl, b, h, n).clone()
    token[:, 1, :, 0] = -1  # a padding slot
    stats = {k: torch.rand(nl, b, h, g, n, generator=gen) for k in STAT_NAMES}
    return EvictionView(keys=torch.randn(nl, b, h, n, d, generator=gen), values=torch.randn(nl, b, h, n, d, generator=gen),
                        token=token, stats=stats, evictable=token >= 0, n_evict=2, step=0, seen=seen, prompt_len=0)


def test_an_age_scorer_reads_log_one_plus_each_slot_s_age_last():
    view = hand_view()
    plain = ScorerBank(3, 2, 8, 2, hidden=8, seed=2)
    aged = ScorerBank(3, 2, 8, 2, hidden=8, features=("key", "value", "attn", "age"), seed=2)
    assert aged.d_in == plain.d_in + 1 and aged.spec()["features"][-1] == "age"
    x = aged.inputs(view)
    assert torch.equal(x[..., :-1], plain.inputs(view))
    age = (view.seen - 1 - view.token).clamp(min=0).float()
    assert torch.equal(x[..., -1], torch.log1p(age))
    assert x[0, 0, 0, -1, -1] == torch.log1p(torch.tensor(float(view.seen - 1 - view.token[0, 0, 0, -1])))
    with pytest.raises(ValueError, match="reads the keys' age"):
        aged.assemble(view.keys, view.values, view.stats)
    with pytest.raises(ValueError, match="no key, value or attention"):
        ScorerBank(3, 2, 8, 2, features=("age",))
    with pytest.raises(ValueError, match="unknown scorer features"):
        ScorerBank(3, 2, 8, 2, features=("key", "position"))


def test_an_age_scorer_scores_the_same_one_layer_at_a_time(monkeypatch):
    """The policy's layer-sliced path (a large model's) passes each slice its own ages."""
    from foresight.engine import features
    from foresight.scorers.bank import LearnedPolicy

    view = hand_view()
    bank = ScorerBank(3, 2, 8, 2, hidden=8, features=("key", "value", "attn", "age"), seed=4)
    with torch.no_grad():
        bank.ln_w[1].mul_(3.0)  # layers that differ
    whole = LearnedPolicy(bank).score(view)
    monkeypatch.setattr(features, "ALL_LAYERS_MAX_VALUES", 1)
    assert torch.allclose(LearnedPolicy(bank).score(view), whole, atol=1e-6)
    older = dataclasses.replace(view, seen=view.seen + 100)  # the same slots, every key 100 tokens older
    assert not torch.allclose(LearnedPolicy(bank).score(older), whole)


def test_head_mean_averages_each_token_over_the_kv_heads_that_hold_it():
    from foresight.engine.features import head_mean

    gen = torch.Generator().manual_seed(5)
    lead, h, n, S, seen = (2, 3), 4, 6, 5, 11
    token = torch.stack([torch.randperm(seen, generator=gen)[:n] for _ in range(2 * 3 * h)]).view(*lead, h, n)
    token[0, 1, 2, 0] = -1  # padding slots: -1, in several heads of one row
    token[0, 1, 3, 4] = -1
    values = torch.randn(*lead, h, n, S, generator=gen)
    got = head_mean(values, token)
    for i in range(2):
        for j in range(3):
            for a in range(h):
                for s in range(n):
                    same = token[i, j] == token[i, j, a, s]  # [h, n]: the slots holding this token, in every head
                    assert same.sum() <= h
                    want = values[i, j][same].mean(0)
                    assert torch.allclose(got[i, j, a, s], want, atol=1e-6)
    # a token in one head only keeps its own values; the rows (leading indices) never mix
    alone = (token[..., None, None] == token[..., None, None, :, :].transpose(-3, -4)).flatten(-2).sum(-1) == 1
    assert alone.any() and torch.allclose(got[alone], values[alone])
    assert torch.equal(head_mean(values[:1], token[:1]), got[:1])


def test_a_heads_scorer_reads_the_other_kv_heads_statistics_of_the_same_token(monkeypatch):
    """`heads`: 8 more inputs, the group-mean log-statistics averaged over the KV heads holding the token; changing
    another head's statistics of a shared token changes them, of a token that head alone holds does not; the
    layer-sliced path gives the same scores."""
    from foresight.engine import features
    from foresight.engine.features import STAT_NAMES
    from foresight.scorers.bank import LearnedPolicy

    view = hand_view()
    view.token[:, :, 1] = torch.roll(view.token[:, :, 1], 1, dims=-1)  # head 1 holds the tokens in other slots
    free = sorted(set(range(view.seen)) - set(view.token[0, 0, 0].tolist()) - set(view.token[0, 0, 1].tolist()))
    view.token[:, 0, 1, 0] = free[0]  # ... and one token head 0 does not hold
    plain = ScorerBank(3, 2, 8, 2, hidden=8, seed=2)
    bank = ScorerBank(3, 2, 8, 2, hidden=8, features=("key", "value", "attn", "heads"), seed=2)
    assert bank.d_in == plain.d_in + len(STAT_NAMES) and bank.spec()["features"][-1] == "heads"
    x = bank.inputs(view)
    assert torch.equal(x[..., :plain.d_in], plain.inputs(view))
    logs = torch.stack([torch.log(view.stats[k] + 1e-6) for k in STAT_NAMES], -1).mean(-3)  # [nl, b, h, n, 8]
    tok = view.token[0, 0]
    s1 = int((tok[1] == tok[0, 3]).nonzero())  # where head 1 holds head 0's slot-3 token
    assert torch.allclose(x[0, 0, 0, 3, plain.d_in:], (logs[0, 0, 0, 3] + logs[0, 0, 1, s1]) / 2, atol=1e-6)
    assert torch.allclose(x[0, 0, 1, 0, plain.d_in:], logs[0, 0, 1, 0], atol=1e-6)  # head 1's own token
    with pytest.raises(ValueError, match="no token indices"):
        bank.assemble(view.keys, view.values, view.stats)
    moved = {k: v.clone() for k, v in view.stats.items()}
    for k in STAT_NAMES:
        moved[k][0, 0, 1, :, s1] += 0.3  # head 1's statistics of the shared token
        moved[k][0, 0, 1, :, 0] += 0.3  # ... and of its own token
    y = bank.inputs(dataclasses.replace(view, stats=moved))
    assert not torch.allclose(y[0, 0, 0, 3], x[0, 0, 0, 3])
    other = [s for s in range(tok.shape[-1]) if s != 3 and tok[0, s] >= 0]
    assert torch.equal(y[0, 0, 0, other], x[0, 0, 0, other])
    whole = LearnedPolicy(bank).score(view)
    monkeypatch.setattr(features, "ALL_LAYERS_MAX_VALUES", 1)
    assert torch.allclose(LearnedPolicy(bank).score(view), whole, atol=1e-6)


def test_head_mean_of_no_slots_is_empty():
    from foresight.engine.features import head_mean

    assert head_mean(torch.zeros(2, 3, 0, 8), torch.zeros(2, 3, 0, dtype=torch.long)).shape == (2, 3, 0, 8)


def test_a_bfloat16_first_product_rounds_the_scores_and_keeps_their_order():
    """``precision="bfloat16"``: the same scores up to bf16 rounding of the first product (not bit-identical: the
    option does run in bf16), the same ranking but for near-ties; an unknown precision is refused."""
    from foresight.scorers.bank import LearnedPolicy

    view = hand_view(seen=400, n=200, d=16)
    bank = ScorerBank(3, 2, 16, 2, hidden=64, seed=5)
    exact = LearnedPolicy(bank).score(view)
    fast = LearnedPolicy(bank, precision="bfloat16").score(view)
    assert not torch.equal(exact, fast)
    assert (fast - exact).abs().max() < 0.02 * exact.abs().max()
    ranks = lambda s: s.argsort(-1).argsort(-1).float()  # noqa: E731
    a, b = ranks(exact).flatten(0, 2), ranks(fast).flatten(0, 2)
    spearman = ((a - a.mean(-1, keepdim=True)) * (b - b.mean(-1, keepdim=True))).mean(-1) / (a.var(-1, False))
    assert spearman.min() > 0.99
    with pytest.raises(ValueError, match="unknown scorer precision 'int8'"):
        LearnedPolicy(bank, precision="int8")
