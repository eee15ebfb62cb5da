"""The scorer bank: one 2-layer MLP per (layer, KV head), all evaluated in one batched call, and the policy that
evicts by it.

Input per candidate (detached from the LLM): ``[key; value; attention statistics]`` — the key after the k-norm
and RoPE, the value, and the 8 statistics of :mod:`foresight.engine.features` for each query head of the group — and, for a
scorer built with ``features`` holding ``"heads"``, the same token's log-statistics averaged over every KV head of the
layer that holds it (:func:`foresight.engine.features.head_mean`), with ``"ahead"``, the recent queries' attention as if
they were 16–128 tokens later (``features.AHEAD_NAMES``, per query head of the group), with ``"age"``,
``log(1 + age)`` of the key (:func:`foresight.engine.features.age_feature`).
Normalisation (the released code creates a LayerNorm and never uses it): statistics are compressed with
``log(x + 1e-6)`` (they are probabilities spanning orders of magnitude), then the whole input vector goes
through a LayerNorm with a learnable affine per (layer, KV head). Output: an eviction score per candidate
(higher = evict first). Parameters stay fp32 whatever the LLM's dtype. A policy may run the first product (the bulk of
an eviction's work) in bfloat16 (:data:`PRECISIONS`): inputs and weights rounded, products accumulated in fp32 by the
CPU's and GPU's bf16 kernels, the rest in fp32 — about 2.5× faster where the hardware has bf16 products, with scores
that differ from the trained ones by rounding (a near-tie may flip). Its standalone checkpoint (shared with KVpop's
scorers) is :mod:`foresight.scorers.checkpoint`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from foresight.engine import features
from foresight.engine.features import AHEAD_NAMES, BLOCK_INPUTS, SCORER_INPUTS, STAT_INPUTS, STAT_NAMES, age_feature, \
    feature_dim, heads_feature, stat_vector, token_age
from foresight.engine.models import describe
from foresight.policies.base import Policy

# the precision of the scorer's first product: float32 reproduces the trained scores exactly
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}

ACTIVATIONS = {"gelu": nn.functional.gelu, "relu": nn.functional.relu, "silu": nn.functional.silu,
               "tanh": torch.tanh}


class ScorerBank(nn.Module):
    """Per-(layer, KV head) MLPs ``D_in → hidden → 1``: ``forward(x [nl, b, h, n, D_in]) -> [nl, b, h, n]``.

    The output layer has no bias: scores are only ever compared within one (layer, sequence, KV head) — top-L,
    the Top-2L sampler, the pairwise ranking loss and GRPO's Plackett–Luce log-probabilities are all unchanged by
    a constant shift — so an output bias would get an exactly-zero gradient whose float noise Adam turns into
    lr-sized random steps (what made DeepSpeed and one-process GRPO runs drift apart)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, group: int, hidden: int = 16,
                 activation: str = "gelu", features=("key", "value", "attn"), seed: int = 0):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
        bad = set(features) - set(SCORER_INPUTS)
        if bad:
            raise ValueError(f"unknown scorer features {sorted(bad)}; known: {', '.join(SCORER_INPUTS)}")
        if not set(features) - {"age"}:
            raise ValueError(f"scorer features {list(features)} read no key, value or attention statistic")
        self.num_layers, self.kv_heads, self.head_dim, self.group = num_layers, kv_heads, head_dim, group
        self.hidden, self.activation, self.features = hidden, activation, tuple(features)
        d_in = feature_dim(head_dim, group, self.features)
        self.d_in = d_in
        g = torch.Generator().manual_seed(seed)
        self.ln_w = nn.Parameter(torch.ones(num_layers, kv_heads, d_in))
        self.ln_b = nn.Parameter(torch.zeros(num_layers, kv_heads, d_in))
        self.w1 = nn.Parameter(torch.randn(num_layers, kv_heads, d_in, hidden, generator=g) / math.sqrt(d_in))
        self.b1 = nn.Parameter(torch.zeros(num_layers, kv_heads, hidden))
        self.w2 = nn.Parameter(torch.randn(num_layers, kv_heads, hidden, generator=g) / math.sqrt(hidden))

    @property
    def reads_attention(self) -> bool:
        """Whether any input comes from the attention statistics (``attn``, ``heads``, ``ahead``)."""
        return bool(set(STAT_INPUTS) & set(self.features))

    @property
    def stat_names(self) -> tuple:
        """The names of the view's statistics this scorer reads."""
        block = STAT_NAMES if set(BLOCK_INPUTS) & set(self.features) else ()
        return block + (AHEAD_NAMES if "ahead" in self.features else ())

    def inputs(self, view) -> torch.Tensor:
        """Detached fp32 scorer inputs [nl, b, h, n, D_in] from an :class:`~foresight.engine.view.EvictionView`."""
        return self.assemble(view.keys, view.values, view.stats, self.ages(view), view.token)

    def ages(self, view) -> torch.Tensor | None:
        """The view's slot ages [nl, b, h, n] when this scorer reads them (else None)."""
        return token_age(view.token, view.seen) if "age" in self.features else None

    def assemble(self, keys: torch.Tensor, values: torch.Tensor, stats, age: torch.Tensor | None = None,
                 token: torch.Tensor | None = None) -> torch.Tensor:
        """Detached fp32 scorer inputs [..., n, D_in] from keys and values [..., h, n, d], the statistics
        ``{name: [..., h, g, n]}`` (read only when the scorer uses attention), the ages in tokens ``[..., h, n]`` (read
        only when it uses age) and the tokens the slots hold ``[..., h, n]`` (read only when it uses ``heads``): the one
        place they are put together, for training, the cache and the kvpress adapter alike."""
        parts = []
        if "key" in self.features:
            parts.append(keys.detach().float())
        if "value" in self.features:
            parts.append(values.detach().float())
        reads_block = bool(set(BLOCK_INPUTS) & set(self.features))
        logs = torch.log(stat_vector(stats).detach().float() + 1e-6) if reads_block else None
        if "attn" in self.features:
            parts.append(logs)
        if "heads" in self.features:
            if token is None:
                raise ValueError("this scorer reads the statistics of every KV head (scorer.features holds 'heads') but "
                                 "no token indices were given")
            parts.append(heads_feature(logs, self.group, token))
        if "ahead" in self.features:
            parts.append(torch.log(stat_vector(stats, AHEAD_NAMES).detach().float() + 1e-6))
        if "age" in self.features:
            if age is None:
                raise ValueError("this scorer reads the keys' age (scorer.features holds 'age') but none was given")
            parts.append(age_feature(age.detach()).to(parts[0].device))
        return torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor, precision: str = "float32", layers: slice = slice(None),
                folded: bool = False) -> torch.Tensor:
        """:meth:`forward_layers` through the module's call (so that hooks such as ZeRO-3's gather of partitioned
        parameters run)."""
        return self.forward_layers(layers, x, precision, folded)

    def forward_layers(self, layers: slice, x: torch.Tensor, precision: str = "float32",
                       folded: bool = False) -> torch.Tensor:
        """The MLPs of a slice of layers: x [nl', b, h, n, D_in] -> [nl', b, h, n]. The first product is one batched
        product over the (layer, KV head) pairs, written out (an einsum dispatches ~13 reshapes for it; the kernel and
        the values are the same), in ``precision`` (:data:`PRECISIONS`). The second stays an einsum: it picks its
        operand order by layout, and the scores must stay bit-identical to the trained scorers' (a different summation
        order would move near-ties).

        ``folded`` (training): the layer norm's scale and shift are folded into the first product's weights and bias,
        the same function up to rounding. The product's input then needs no gradient, so the backward computes one
        product per (layer, KV head), the weights', instead of two."""
        nl, b, h, n, d = x.shape
        x = nn.functional.layer_norm(x.float(), (self.d_in,))
        if folded:
            w1 = self.ln_w[layers, :, :, None] * self.w1[layers]
            b1 = torch.einsum("lhd,lhdk->lhk", self.ln_b[layers], self.w1[layers]) + self.b1[layers]
        else:
            x = x * self.ln_w[layers, None, :, None, :] + self.ln_b[layers, None, :, None, :]
            w1, b1 = self.w1[layers], self.b1[layers]
        x, w1 = x.transpose(1, 2).reshape(nl * h, b * n, d), w1.reshape(nl * h, d, self.hidden)
        if precision == "float32":
            hdn = torch.bmm(x, w1)
        else:
            hdn = torch.bmm(x.to(PRECISIONS[precision]), w1.to(PRECISIONS[precision])).float()
        hdn = hdn.view(nl, h, b, n, self.hidden).transpose(1, 2) + b1[:, None, :, None, :]
        hdn = ACTIVATIONS[self.activation](hdn)
        return torch.einsum("lbhnk,lhk->lbhn", hdn, self.w2[layers])

    def forward_layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """One layer's MLPs: x [b, h, n, D_in] -> [b, h, n] (used by per-layer hooks such as kvpress)."""
        x = nn.functional.layer_norm(x.float(), (self.d_in,))
        x = x * self.ln_w[layer][None, :, None, :] + self.ln_b[layer][None, :, None, :]
        hdn = torch.einsum("bhnd,hdk->bhnk", x, self.w1[layer]) + self.b1[layer][None, :, None, :]
        hdn = ACTIVATIONS[self.activation](hdn)
        return torch.einsum("bhnk,hk->bhn", hdn, self.w2[layer])

    def spec(self) -> dict:
        return {"num_layers": self.num_layers, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "group": self.group, "hidden": self.hidden, "activation": self.activation,
                "features": list(self.features), "stats": list(self.stat_names or STAT_NAMES), "d_in": self.d_in,
                "normalisation": "log(stats+1e-6), " + ("heads: the log-statistics' mean over the group, then over the "
                                                        "KV heads holding the token, " if "heads" in self.features else "")
                                 + ("log1p(age), " if "age" in self.features else "")
                                 + "layernorm + affine per (layer, kv head)"}


class LearnedPolicy(Policy):
    """Eviction by a trained :class:`ScorerBank` (higher score = evict first)."""

    name = "learned"

    def __init__(self, bank: ScorerBank, label: str = "foresight", precision: str = "float32"):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown scorer precision {precision!r}; known: {', '.join(PRECISIONS)}")
        self.bank, self.name, self.precision = bank, label, precision
        self.reads = frozenset(bank.stat_names)  # a key/value-only scorer needs no attention

    @torch.no_grad()
    def score(self, view):
        """Scores [nl, b, h, n], a slice of layers at a time when all layers' inputs would exceed
        ``features.ALL_LAYERS_MAX_VALUES`` (one call for a small model; one layer at a time for Qwen3-4B, whose 36 layers'
        inputs at B=2048 are ~180 M values per sequence), so the working memory does not grow with depth."""
        p = next(self.bank.parameters())
        nl, b, h, n = view.keys.shape[:4]
        per_layer = b * h * n * self.bank.d_in
        step = max(1, features.ALL_LAYERS_MAX_VALUES // max(per_layer, 1))
        if step >= nl:
            return self.bank(self.bank.inputs(view).to(p.device), self.precision).to(view.keys.device)
        attn = self.bank.reads_attention
        age = self.bank.ages(view)
        out = view.keys.new_empty((nl, b, h, n), dtype=torch.float32)
        for lo in range(0, nl, step):
            sl = slice(lo, lo + step)
            stats = {k: view.stats[k][sl] for k in self.bank.stat_names} if attn else {}
            x = self.bank.assemble(view.keys[sl], view.values[sl], stats, None if age is None else age[sl],
                                   view.token[sl])
            out[sl] = self.bank(x.to(p.device), self.precision, sl).to(out.device)
        return out


def bank_for_model(model, hidden: int = 16, activation: str = "gelu", features=("key", "value", "attn"),
                   seed: int = 0) -> ScorerBank:
    d = describe(model)
    return ScorerBank(d["num_layers"], d["num_key_value_heads"], d["head_dim"],
                      d["num_attention_heads"] // d["num_key_value_heads"], hidden, activation, features, seed)
