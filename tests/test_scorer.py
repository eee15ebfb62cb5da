"""The scorer bank's arithmetic: the fast path (a batched product written out instead of an einsum, issue #16) must give
the scores and gradients of the plain formulation bit for bit, so that no kept set of a trained scorer moves."""

import pytest
import torch
from torch import nn

from foresight.scorer import ACTIVATIONS, ScorerBank


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
