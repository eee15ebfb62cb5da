"""KVpop's scorers (arXiv 2607.05061 §3.3) and the policy that runs them inside the bounded cache.

Both emit a retention priority ``r`` per (layer, KV head, token) — higher = keep — from inputs detached from the
LLM: the cached key (after k-norm and RoPE) and value, ``x = [k; v]``.

* :class:`KVpopMLP` — stateless: ``r_t = MLP(LN(x_t))``, two layers with SiLU (the paper's KVpop-mlp).
* :class:`KVpopMLSTM` — stateful: a matrix memory per (layer, KV head), mLSTM-style, updated with every new pair::

      C_j = f_j C_{j−1} + i_j ṽ_j k̃_jᵀ,   z_j = f_j z_{j−1} + i_j k̃_j      (k̃, ṽ, q̃: projections of LN(x))
      h(t, τ) = C_τ q̃_t / max(|z_τ · q̃_t|, 1),     r_t = MLP([LN(x_t); h(t, τ)])

  *delayed* read-out: ``τ = t + w``, the moment token ``t`` leaves the protected window, so the memory has seen
  the ``w`` tokens that followed it; *immediate*: ``τ = t`` (scored at insertion). Gates are sigmoids
  (``f`` biased towards remembering); the paper's exponential input gate with its stabiliser is left out —
  with a read-out normaliser ``max(|z·q|, 1)`` the sigmoid form is stable without one.

The cache ranks the candidates (tokens past the window, not sinks) by the static priority of
:func:`foresight.scorers.kvpop_topk.static_priority`, i.e. with the temporal decay, and evicts the lowest. The same
chunk recurrence (:func:`mlstm_chunk`) serves training (whole traces, by blocks) and the cache (the pairs of
each forward), so the priorities seen in training are those computed at inference (tested).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from foresight.scorers.kvpop_spec import KVpopSpec
from foresight.scorers.kvpop_topk import static_priority, trace_priority
from foresight.engine.models import describe
from foresight.policies.base import Policy
from foresight.scorers.bank import ScorerBank

PRIO = "kvpop_r"  # the cache's per-slot tensor holding the mLSTM's read-out priorities


def mlstm_chunk(k, v, logf, ig, qr, C0, z0):
    """One chunk of the recurrence, in parallel form. k, qr: [..., c, m]; v: [..., c, mv]; logf, ig: [..., c];
    C0: [..., mv, m]; z0: [..., m]. Returns (read-outs [..., c, mv] of ``C_τ q̃`` normalised, C1, z1)."""
    a = logf.cumsum(-1)  # a_τ = Σ_{j ≤ τ} log f_j (≤ 0, decreasing)
    c = a.shape[-1]
    causal = torch.ones(c, c, dtype=torch.bool, device=a.device).tril()
    decay = torch.exp((a[..., :, None] - a[..., None, :]).masked_fill(~causal, float("-inf")))  # [..., τ, j]
    w = decay * ig[..., None, :] * torch.matmul(qr, k.transpose(-1, -2))  # [..., τ, j]
    carry = torch.exp(a)[..., None]  # [..., c, 1]
    num = carry * torch.matmul(qr, C0.transpose(-1, -2)) + torch.matmul(w, v)  # [..., c, mv]
    den = carry[..., 0] * (qr * z0[..., None, :]).sum(-1) + w.sum(-1)  # [..., c]
    out = num / den.abs().clamp(min=1.0)[..., None]
    tail = torch.exp(a[..., -1:] - a) * ig  # weight of each j in the final state
    C1 = torch.exp(a[..., -1])[..., None, None] * C0 + torch.matmul((v * tail[..., None]).transpose(-1, -2), k)
    z1 = torch.exp(a[..., -1])[..., None] * z0 + (k * tail[..., None]).sum(-2)
    return out, C1, z1


class _KVpopScorer(nn.Module):
    """What both scorers share: the KVpop layout (sinks, window), the decay, the spec and the policy hook."""

    kind = "kvpop"
    stateful = False

    def _setup(self, spec: KVpopSpec):
        num_layers, kv_heads, head_dim, group = spec.num_layers, spec.kv_heads, spec.head_dim, spec.group
        window, sinks, gamma, decay_step = spec.window, spec.sinks, spec.gamma, spec.decay_step
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"kvpop.gamma must be in (0, 1], got {gamma}")
        if decay_step < 1:
            raise ValueError(f"kvpop.decay_step must be >= 1, got {decay_step}")
        self.num_layers, self.kv_heads, self.head_dim, self.group = num_layers, kv_heads, head_dim, group
        self.window, self.sinks, self.decay_step, self.gamma = window, sinks, decay_step, gamma
        self.register_buffer("log_gamma", torch.full((num_layers, kv_heads), math.log(gamma)))

    def priority(self, r: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Static priority of [nl, b, h, n] read-outs (``token``: their indices); see kvpop.topk."""
        return static_priority(r, token, self.log_gamma[:, None, :, None], self.decay_step)

    def sequence_priorities(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Whole-trace static priorities: keys/values [nl, h, S, d] -> [nl, h, S]."""
        r = self.sequence_scores(keys, values)
        return trace_priority(r, self.log_gamma[:, :, None], self.decay_step)

    def base_spec(self) -> dict:
        return {"kind": self.kind, "num_layers": self.num_layers, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "group": self.group, "window": self.window, "sinks": self.sinks,
                "gamma": self.gamma, "decay_step": self.decay_step, "features": ["key", "value"],
                "d_in": 2 * self.head_dim}


class KVpopMLP(_KVpopScorer):
    """The stateless scorer of ``spec`` (its mLSTM settings are not used)."""

    kind = "kvpop-mlp"

    def __init__(self, spec: KVpopSpec):
        super().__init__()
        self._setup(spec)
        self.hidden = spec.hidden
        self.mlp = ScorerBank(spec.num_layers, spec.kv_heads, spec.head_dim, spec.group, spec.hidden, "silu",
                              ("key", "value"), spec.seed)

    def sequence_scores(self, keys, values):
        x = torch.cat([keys, values], -1).float().unsqueeze(1)  # [nl, 1, h, S, 2d]
        return self.mlp(x)[:, 0]

    def view_scores(self, view):
        p = next(self.parameters())
        return self.mlp(self.mlp.inputs(view).to(p.device)).to(view.keys.device)

    def spec(self):
        return self.base_spec() | {"hidden": self.hidden, "activation": "silu"}


class KVpopMLSTM(_KVpopScorer):
    """The stateful scorer of ``spec``."""

    kind = "kvpop-mlstm"
    stateful = True

    def __init__(self, spec: KVpopSpec):
        super().__init__()
        self._setup(spec)
        hidden, memory_dim = spec.hidden, spec.memory_dim
        self.hidden, self.memory_dim, self.delayed, self.block = hidden, memory_dim, bool(spec.delayed), spec.block
        nl, h, D, m = spec.num_layers, spec.kv_heads, 2 * spec.head_dim, memory_dim
        g = torch.Generator().manual_seed(spec.seed)

        def rnd(*shape, fan):
            return nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(fan))

        self.ln_w, self.ln_b = nn.Parameter(torch.ones(nl, h, D)), nn.Parameter(torch.zeros(nl, h, D))
        self.wq, self.wk, self.wv = rnd(nl, h, D, m, fan=D), rnd(nl, h, D, m, fan=D), rnd(nl, h, D, m, fan=D)
        self.wg = rnd(nl, h, D, 2, fan=D)  # input and forget gate pre-activations
        self.bg = nn.Parameter(torch.tensor([0.0, 3.0]).expand(nl, h, 2).clone())  # f starts near 0.95
        self.w1 = rnd(nl, h, D + m, hidden, fan=D + m)
        self.b1 = nn.Parameter(torch.zeros(nl, h, hidden))
        self.w2 = rnd(nl, h, hidden, fan=hidden)  # no output bias: priorities are compared within a head

    # ---------------------------------------------------------------------------------------- pieces
    def _project(self, layer: int, x: torch.Tensor, valid: torch.Tensor | None = None):
        """x [b, h, c, D] -> (LN(x), k̃, ṽ, q̃, log f, i); invalid (padding) positions leave the memory alone."""
        D = x.shape[-1]
        xn = nn.functional.layer_norm(x.float(), (D,)) * self.ln_w[layer][None, :, None] + self.ln_b[layer][None, :, None]
        proj = lambda w: torch.einsum("bhcd,hdm->bhcm", xn, w[layer])  # noqa: E731
        k, v, q = proj(self.wk) / math.sqrt(self.memory_dim), proj(self.wv), proj(self.wq)
        gates = torch.einsum("bhcd,hdt->bhct", xn, self.wg[layer]) + self.bg[layer][None, :, None]
        ig, logf = torch.sigmoid(gates[..., 0]), nn.functional.logsigmoid(gates[..., 1])
        if valid is not None:
            ig, logf = ig * valid[:, None], logf * valid[:, None]
        return xn, k, v, q, logf, ig

    def _head(self, layer: int, xn: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        hdn = torch.einsum("bhcd,hdk->bhck", torch.cat([xn, mem], -1), self.w1[layer]) + self.b1[layer][None, :, None]
        return torch.einsum("bhck,hk->bhc", nn.functional.silu(hdn), self.w2[layer])

    def _zero_state(self, b: int, device):
        h, m = self.kv_heads, self.memory_dim
        return torch.zeros(b, h, m, m, device=device), torch.zeros(b, h, m, device=device)

    # ------------------------------------------------------------------------------------- training
    def sequence_scores(self, keys, values):
        """Whole traces (no padding): keys/values [nl, h, S, d] -> read-out priorities r [nl, h, S]."""
        nl, h, S, _ = keys.shape
        w = self.window if self.delayed else 0
        out = []
        for layer in range(nl):
            x = torch.cat([keys[layer], values[layer]], -1).float()[None]  # [1, h, S, D]
            xn, k, v, q, logf, ig = self._project(layer, x)
            qr = torch.zeros_like(q)  # read-out query at position τ: token τ − w's
            if w < S:
                qr[:, :, w:] = q[:, :, : S - w]
            C, z = self._zero_state(1, x.device)
            reads = []
            for c0 in range(0, S, self.block):
                c1 = min(S, c0 + self.block)
                o, C, z = mlstm_chunk(k[:, :, c0:c1], v[:, :, c0:c1], logf[:, :, c0:c1], ig[:, :, c0:c1],
                                      qr[:, :, c0:c1], C, z)
                reads.append(o)
            mem = torch.cat(reads, 2)[:, :, w:]  # read-outs of tokens 0 .. S − 1 − w
            if w:  # the last w tokens never leave the window here: read them against the final memory
                qt = q[:, :, S - min(w, S):]
                tail = torch.matmul(qt, C.transpose(-1, -2)) / (qt * z[:, :, None]).sum(-1).abs().clamp(min=1)[..., None]
                mem = torch.cat([mem, tail], 2)
            out.append(self._head(layer, xn, mem)[0])
        return torch.stack(out)

    # ------------------------------------------------------------------------------------ inference
    def observe(self, cache, layer: int, n_old: int, count: int) -> None:
        """New pairs in slots [n_old, n_old + count): update the memory; score the tokens that leave the window
        (delayed) or the new tokens themselves (immediate) into the cache's per-slot priorities."""
        if count > self.block:  # a long one-shot prefill: bounded [block × block] work at a time
            for c0 in range(0, count, self.block):
                self._observe_part(cache, layer, n_old, c0, min(self.block, count - c0))
            return
        self._observe_part(cache, layer, n_old, 0, count)

    def _observe_part(self, cache, layer: int, n_old: int, c0: int, count: int) -> None:
        valid = cache.chunk_valid[:, c0:c0 + count].float()  # [b, count]
        n_old = n_old + c0
        K, V = cache.keys[layer], cache.values[layer]
        x_new = torch.cat([K[:, :, n_old:n_old + count], V[:, :, n_old:n_old + count]], -1)
        state = cache.policy_state.get(layer)
        if state is None:
            state = self._zero_state(K.shape[0], K.device)
        _, k, v, q, logf, ig = self._project(layer, x_new, valid)
        w = self.window if self.delayed else 0
        read_slots = torch.arange(n_old - w, n_old + count - w, device=K.device)
        ok = read_slots >= 0
        rs = read_slots.clamp(min=0)
        x_read = torch.cat([K[:, :, rs], V[:, :, rs]], -1)
        xn_read, _, _, q_read, _, _ = self._project(layer, x_read)
        mem, C, z = mlstm_chunk(k, v, logf, ig, q_read, *state)
        cache.policy_state[layer] = (C, z)
        r = self._head(layer, xn_read, mem)  # [b, h, count]
        prio = cache.slot_tensor(PRIO)
        prio[layer][:, :, read_slots[ok]] = r[:, :, ok].to(prio.dtype)

    def view_scores(self, view):
        if PRIO not in view.slot:
            raise RuntimeError("the KVpop mLSTM scorer has no priorities in this cache: it must observe every "
                               "new pair (use it as the cache's policy from the first token)")
        return view.slot[PRIO]

    def spec(self):
        return self.base_spec() | {"hidden": self.hidden, "activation": "silu", "memory_dim": self.memory_dim,
                                   "delayed": self.delayed, "block": self.block}


SCORERS = {"kvpop-mlp": KVpopMLP, "kvpop-mlstm": KVpopMLSTM}


def build_from_spec(spec: dict) -> _KVpopScorer:
    """The scorer a checkpoint's ``scorer`` spec describes (:meth:`KVpopSpec.from_dict`: an unknown key is an
    error)."""
    kind = spec.get("kind")
    if kind not in SCORERS:
        raise ValueError(f"unknown KVpop scorer kind {kind!r}; known: {', '.join(SCORERS)}")
    return SCORERS[kind](KVpopSpec.from_dict(spec))


def scorer_for_model(model, cfg, budget: int, seed: int = 0) -> _KVpopScorer:
    """A fresh scorer for ``model`` from a recipe's ``kvpop`` section (budget B = sinks + window + k)."""
    d = describe(model)
    if budget - cfg.sinks - cfg.window <= 0:
        raise ValueError(f"KVpop layout: budget B={budget} leaves no top-k room after sinks={cfg.sinks} and "
                         f"window={cfg.window} (k = B − s − w must be > 0)")
    spec = KVpopSpec(num_layers=d["num_layers"], kv_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
                     group=d["num_attention_heads"] // d["num_key_value_heads"], window=cfg.window, sinks=cfg.sinks,
                     gamma=cfg.gamma, decay_step=cfg.decay_step, hidden=cfg.hidden, seed=seed)
    if cfg.scorer == "mlp":
        return KVpopMLP(spec)
    if cfg.scorer == "mlstm":
        return KVpopMLSTM(dataclasses.replace(spec, memory_dim=cfg.memory_dim, delayed=cfg.delayed, block=cfg.block))
    raise ValueError(f"kvpop.scorer must be 'mlp' or 'mlstm', got {cfg.scorer!r}")


class KVpopPolicy(Policy):
    """Eviction by a trained KVpop scorer: keeps sinks, the window and the top-k by decayed priority."""

    reads = frozenset()

    def __init__(self, scorer: _KVpopScorer, label: str = "kvpop"):
        self.scorer, self.name = scorer, label
        self.layout_window, self.layout_sinks = scorer.window, scorer.sinks  # the cache takes its layout from these
        if scorer.stateful:
            self.observe = self._observe

    @torch.no_grad()
    def _observe(self, cache, layer, n_old, count):
        self.scorer.observe(cache, layer, n_old, count)

    @torch.no_grad()
    def score(self, view):
        r = self.scorer.view_scores(view).float()
        return -self.scorer.priority(r, view.token)  # lowest priority is evicted first
