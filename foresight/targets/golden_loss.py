"""Golden pooling ``loss``: a pair's block score is how much its eviction would move the loss, to first order.

Attention golden (:mod:`foresight.targets.golden`) ranks a pair by the attention the future gives it; what eviction costs is
the loss. This pooling asks the frozen model: one dense teacher-forced pass of the trace, with the gradient of its
summed token NLL ``ℒ`` taken with respect to every attention logit ``s_ij`` (query ``i``, key ``j``, per layer and
query head). Dropping key ``j`` from query ``i``'s softmax moves its probabilities by ``Δp_j = −p_j`` and ``Δp_k =
p_k p_j / (1 − p_j)``, so to first order

    ``Δℒ_ij = Σ_k ∂ℒ/∂p_ik Δp_ik = −(∂ℒ/∂s_ij) / (1 − p_ij)``

(``∂ℒ/∂s_ij = p_ij (∂ℒ/∂p_ij − Σ_k p_ik ∂ℒ/∂p_ik)``, softmax's backward; tested against finite differences). The
gradient reaches each logit through every later layer and token, so a pair whose value a later layer needs for the
next token costs more than one attended to by habit.

Block score ``a_u[h, j] = Σ_{g ∈ group(h), q ∈ u} |Δℒ_qj|`` (the magnitude per query head and query: a signed sum
ranks the pairs whose removal lowers the loss to first order lowest, and evicting them is what the linearisation
gets most wrong — on SmolLM2 that golden's loss ratio was 1.81 against attention golden's 1.04 at B=128); the future
score is :class:`~foresight.targets.block_pooler.BlockPooler`'s, the max over the blocks to come. Measured on SmolLM2
(docs/results/smollm2-135m/probe-sft-variants/golden-loss/): a worse teacher than attention golden at both budgets
measured — the option is kept for that comparison and for other models; the recipes keep ``mean``.

Cost: one forward and one backward of the frozen model per trace (no weight gradients: only the input embeddings
require one), holding the explicit [query heads, S, S] attention of every layer for the backward — fine for the
~1k-token traces of a CPU benchmark (SmolLM2, 1.1k tokens: ~7 GB resident), too much for a 16k-token trace of a 4B model.
"""

from __future__ import annotations

import torch

from foresight.engine import attention as attn_mod
from foresight.targets.block_pooler import BlockPooler
from foresight.engine.attention_shape import AttentionShape


class LossPooler(BlockPooler):
    """:class:`~foresight.targets.block_pooler.BlockPooler` whose rows ``a_u`` hold first-order loss costs (filled by
    :func:`loss_pooled_cost`, one trace per backward). ``magnitude=False`` sums the signed costs instead (tests)."""

    def __init__(self, num_layers: int, kv_heads: int, lengths: list[int], start: int, interval: int, device,
                 magnitude: bool = True):
        super().__init__(num_layers, kv_heads, lengths, start, interval, "mean", device)
        self.magnitude = magnitude
        self.row = 0  # the trace whose backward is running
        self.pooled = 0  # layers whose costs the row's backward has filled

    def attend(self, layer_idx: int, query, key, value, scale):
        """Dense causal attention of the whole trace ([1, Hq, S, d] queries) whose logits' gradient, when the
        backward reaches them, is turned into block costs of this layer."""
        if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
            raise ValueError("the loss pooling takes one whole trace per pass ([1, S] input, no cache)")
        scores, probs, out = attn_mod.dense_causal(query, key, value, scale)
        if scores.requires_grad:
            p = probs.detach()
            scores.register_hook(lambda grad, layer=layer_idx, p=p: self._pool(layer, grad, p))
        return out.transpose(1, 2)

    def _pool(self, layer_idx: int, grad: torch.Tensor, probs: torch.Tensor) -> None:
        """grad, probs: [1, h, g, S, S] -> a[layer, row, u, h, :S] = Σ over the group's heads and block u's queries of
        the first-order loss cost −grad / (1 − p) (its magnitude unless ``magnitude`` is off)."""
        S = grad.shape[-1]
        m = self.blocks(S)
        self.pooled += 1
        if m == 0:
            return
        cost = -grad / (1 - probs).clamp(min=1e-3)
        if self.magnitude:
            cost = cost.abs()
        cost = cost.sum(2)[0, :, self.B:]  # [h, S - B, S]
        pad = m * self.L - cost.shape[1]
        if pad:
            cost = torch.nn.functional.pad(cost, (0, 0, 0, pad))
        self.a[layer_idx, self.row, :m, :, :S] = cost.view(cost.shape[0], m, self.L, S).sum(2).transpose(0, 1)


def loss_pooled_cost(model, input_ids: torch.Tensor, lengths: list[int], start: int, interval: int,
                     magnitude: bool = True) -> LossPooler:
    """The first-order loss costs of every trace of ``input_ids`` [b, S] (right-padded to ``lengths``), blocks
    starting at ``start`` (budget plus protected prefix) of ``interval`` queries; one forward and backward per
    trace."""
    shape = AttentionShape.of(model.config)
    pooler = LossPooler(shape.num_layers, shape.kv_heads, lengths, start, interval, input_ids.device, magnitude)
    embed = model.get_input_embeddings()
    for r, n in enumerate(lengths):
        pooler.row, pooler.pooled = r, 0
        ids = input_ids[r:r + 1, :n]
        with torch.enable_grad(), attn_mod.pooling(pooler):
            emb = embed(ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=emb, use_cache=False).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            torch.autograd.grad(nll, emb)
        if pooler.pooled < shape.num_layers:
            raise RuntimeError("the model's attention never reached the 'foresight' attention function; load it with "
                               "attn_implementation='foresight' (foresight.engine.attention.use_foresight_attention)")
    return pooler
