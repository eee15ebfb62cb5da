"""KVpop's future-attention target (arXiv 2607.05061, Eq. 3–4 and §3.2), computed without an S×S tensor.

For KV head ``h``, query head ``g`` of its GQA group and token ``t``, with protected window ``w``::

    m[h, g, t] = 1/N_t · Σ_{d = t+w}^{S-1} p[g, d → t],      N_t = max(1, S − (t + w))
    r_tgt[h, t] = Agg_g log(ε + m[h, g, t])                  (Agg = max or mean over the group)

``p[g, d → t]`` is the post-softmax attention of query ``d`` to key ``t`` in the dense (full-cache) model: the
attention a token receives *after* it has left the window, which is when KVpop decides to keep or drop it.

Computation (one dense pass per trace, the LLM frozen): inside each layer's attention call, a forward sweep
over query blocks gives every query's log-normaliser ``LSE_d = log Σ_{j ≤ d} exp(ℓ(d, j))`` and the attention
output; a *transposed* sweep then visits, for each key block, the query blocks at or after it and accumulates
``Σ_d exp(ℓ(d, t) − LSE_d)`` — the probabilities are recomputed block by block from the stored LSE, so memory
stays ``O(heads · block²)`` (plus ``O(heads · block · S)`` for the forward sweep). The paper reuses the LSE of
its sparse student pass as an approximation; with a frozen LLM we use the dense pass's, which is exact.

KVpop's *teacher* evicts by this target: :class:`KVpopOraclePolicy` over :func:`kvpop_oracle_priorities` (the
target's static priorities with the recipe's decay), ``kvpop-oracle`` in ``foresight eval``.
"""

from __future__ import annotations

import math

import torch

from foresight.engine import attention as attn_mod
from foresight.scorers.kvpop_topk import trace_priority
from foresight.policies.base import Policy


def _grouped(query: torch.Tensor, h: int) -> torch.Tensor:
    """[Hq, S, d] -> [h, g, S, d]."""
    hq, S, d = query.shape
    return query.view(h, hq // h, S, d)


def forward_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None, scale: float, block: int = 256):
    """Causal attention by query blocks. query [Hq, S, d], key/value [h, S, d] (one sequence, no padding).

    Returns (LSE [h, g, S] fp32, output [Hq, S, d] or None when ``value`` is None)."""
    h, S, _ = key.shape
    qg = _grouped(query, h)
    lse = torch.empty(h, qg.shape[1], S, device=query.device, dtype=torch.float32)
    out = torch.empty_like(qg) if value is not None else None
    for q0 in range(0, S, block):
        q1 = min(S, q0 + block)
        logits = torch.matmul(qg[:, :, q0:q1], key[:, None, :q1].transpose(-1, -2)).float() * scale  # [h,g,bq,q1]
        causal = torch.arange(q1, device=query.device)[None, :] <= torch.arange(q0, q1, device=query.device)[:, None]
        logits = logits.masked_fill(~causal, float("-inf"))
        lse[:, :, q0:q1] = torch.logsumexp(logits, -1)
        if value is not None:
            probs = torch.exp(logits - lse[:, :, q0:q1, None])
            out[:, :, q0:q1] = torch.matmul(probs.to(value.dtype), value[:, None, :q1])
    return lse, (out.reshape(query.shape) if out is not None else None)


def future_attention_mass(query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor, scale: float, window: int,
                          block: int = 256) -> torch.Tensor:
    """The transposed pass: ``Σ_{d ≥ t + window} p[g, d → t]`` for every key ``t`` → [h, g, S] (fp32)."""
    h, S, _ = key.shape
    qg = _grouped(query, h)
    acc = torch.zeros(h, qg.shape[1], S, device=key.device, dtype=torch.float32)
    for k0 in range(0, S, block):
        k1 = min(S, k0 + block)
        first = k0 + window  # the earliest query that counts for this key block
        if first >= S:
            break
        kt = key[:, None, k0:k1].transpose(-1, -2)  # [h,1,d,bk]
        tpos = torch.arange(k0, k1, device=key.device)
        for d0 in range((first // block) * block, S, block):
            d1 = min(S, d0 + block)
            logits = torch.matmul(qg[:, :, d0:d1], kt).float() * scale  # [h,g,bq,bk]
            counts = torch.arange(d0, d1, device=key.device)[:, None] >= tpos[None, :] + window
            p = torch.exp(logits - lse[:, :, d0:d1, None]).masked_fill(~counts, 0.0)
            acc[:, :, k0:k1] += p.sum(2)
    return acc


def target_from_mass(mass: torch.Tensor, window: int, eps: float = 1e-6, agg: str = "max") -> torch.Tensor:
    """[h, g, S] future mass -> r_tgt [h, S]: count-normalised, log with ε, aggregated over the group."""
    S = mass.shape[-1]
    n = (S - (torch.arange(S, device=mass.device) + window)).clamp(min=1).float()
    logm = torch.log(eps + mass / n)
    if agg == "max":
        return logm.amax(1)
    if agg == "mean":
        return logm.mean(1)
    raise ValueError(f"kvpop.agg must be 'max' or 'mean', got {agg!r}")


class TargetTap:
    """Taps every attention call of a dense pass (``attention.pooling``): computes the layer's output and
    target with the blockwise sweeps, and keeps the layer's keys and values (the scorers' inputs)."""

    def __init__(self, window: int, eps: float, agg: str, block: int):
        self.window, self.eps, self.agg, self.block = window, eps, agg, block
        self.targets: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def attend(self, layer_idx: int, query, key, value, scale):
        if query.shape[0] != 1:
            raise ValueError("KVpop targets are computed one trace at a time ([1, S] input)")
        q, k, v = query[0], key[0], value[0]
        lse, out = forward_lse(q, k, v, scale, self.block)
        mass = future_attention_mass(q, k, lse, scale, self.window, self.block)
        self.targets[layer_idx] = target_from_mass(mass, self.window, self.eps, self.agg)
        self.keys[layer_idx], self.values[layer_idx] = k.detach().float(), v.detach().float()
        return out.unsqueeze(0).transpose(1, 2)  # [1, S, Hq, d] like transformers' attention functions


@torch.no_grad()
def kvpop_targets(model, input_ids: torch.Tensor, window: int, eps: float = 1e-6, agg: str = "max",
                  block: int = 256) -> dict:
    """One dense pass over a trace [1, S] (no LM head, so no [S, vocab] logits): per layer ``target`` [nl, h, S],
    and the scorers' inputs ``keys``/``values`` [nl, h, S, d] (after k-norm and RoPE, as cached)."""
    if input_ids.shape[0] != 1:
        raise ValueError("KVpop targets are computed one trace at a time ([1, S] input)")
    tap = TargetTap(window, eps, agg, block)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with attn_mod.pooling(tap):
        decoder(input_ids=input_ids, use_cache=False)
    n = len(tap.targets)
    if n == 0:
        raise RuntimeError("the model's attention never reached the 'foresight' attention function; load it with "
                           "attn_implementation='foresight' (foresight.engine.attention.use_foresight_attention)")
    return {"target": torch.stack([tap.targets[i] for i in range(n)]),
            "keys": torch.stack([tap.keys[i] for i in range(n)]),
            "values": torch.stack([tap.values[i] for i in range(n)])}


# ------------------------------------------------------------------------------------------------ the teacher
class KVpopOraclePolicy(Policy):
    """KVpop's *teacher*: evicts by the true future-attention target's static priority (it needs the future, so
    teacher-forced evaluation only). ``prio``: [b, nl, h, S], one trace per row (see ``kvpop_oracle_priorities``).
    Separates the target's quality from the scorers' on a task."""

    reads = frozenset()

    def __init__(self, prio: torch.Tensor, window: int, sinks: int):
        self.prio, self.layout_window, self.layout_sinks = prio, window, sinks

    def score(self, view):
        idx = view.token.clamp(min=0).permute(1, 0, 2, 3)  # [b, nl, h, n]
        vals = self.prio.to(view.token.device).gather(-1, idx).permute(1, 0, 2, 3)
        return -vals


@torch.no_grad()
def kvpop_oracle_priorities(model, ids: torch.Tensor, kc) -> torch.Tensor:
    """[b, nl, h, S] static target priorities (with the recipe's decay) of equal-length traces ``ids`` [b, S]."""
    out = []
    for row in ids:
        tgt = kvpop_targets(model, row[None], kc.window, kc.eps, kc.agg, kc.block)["target"]  # [nl, h, S]
        out.append(trace_priority(tgt, torch.tensor(math.log(kc.gamma)), kc.decay_step))
    return torch.stack(out)
