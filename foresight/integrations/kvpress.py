"""``ForesightPress``: trained ForesightKV scorers as a kvpress press (optional extra ``foresight[kvpress]``).

Use it inside kvpress's ``DecodingPress`` (compression every L decoding steps down to a target size) or its
``kv-press-text-generation`` pipeline::

    from kvpress import DecodingPress
    from foresight.integrations.kvpress import ForesightPress

    press = DecodingPress(ForesightPress("runs/tiny-qwen3/grpo", protect_recent=64),
                          compression_interval=64, target_size=320, hidden_states_buffer_size=64)
    with press(model):
        out = model.generate(input_ids, max_new_tokens=1000)

kvpress hands a press the buffered hidden states of the decoding steps since the last compression; the press
recomputes their queries (q-projection, q-norm, RoPE at their positions), their attention to the cached keys,
and from it the statistics of :mod:`foresight.engine.features` (block max/min/sum, last-8/16/32 sums; for a scorer that
reads ``ahead``, the last 32 queries' attention rotated 16–128 positions on). The running
cumulative and decayed sums are carried by the press across compressions (they count decoding queries only:
kvpress does not expose the prompt's attention), and so are the kept pairs' positions (for a scorer that reads their
age; before the first compression the cache holds every position in order). kvpress keeps the highest scores, so the press returns
``−(eviction score)``; the newest ``protect_recent`` tokens get ``+inf`` (the paper protects the newest L).
kvpress pins transformers < 5.3, older than the core's; CI tests this adapter in its own environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept, get_prerope_query_states

from foresight.engine.cache import rope_shift
from foresight.scorers.checkpoint import check_compatible, load_scorer, scorer_kind
from foresight.engine.features import AHEAD_NAMES, AHEAD_SHIFTS, DECAY, QUERY_WINDOW


@dataclass
class ForesightPress(ScorerPress):
    scorer_dir: str = ""
    protect_recent: int = 0
    bank: object = field(default=None, repr=False)
    _rotary: object = field(default=None, repr=False)
    _shifts: object = field(default=None, repr=False)
    _state: dict = field(default_factory=dict, repr=False)

    def post_init_from_model(self, model):
        if self.bank is None:
            if not self.scorer_dir:
                raise ValueError("ForesightPress needs scorer_dir (a foresight scorer checkpoint)")
            self.bank, self.config = load_scorer(self.scorer_dir, model, device=next(model.parameters()).device)
            if scorer_kind(self.config["scorer"]) != "foresight":
                raise ValueError(f"{self.scorer_dir} holds {self.config['scorer']['kind']} scorers; ForesightPress "
                                 "runs ForesightKV scorers (use foresight.integrations.hf.ForesightCache for KVpop)")
        else:
            check_compatible(self.config, model)
        self._rotary = next(m for n, m in model.named_modules() if n.endswith("rotary_emb"))
        self._shifts = rope_shift.shift_tables(model.config, AHEAD_SHIFTS, next(model.parameters()).device) \
            if "ahead" in self.bank.features else None
        self._state = {}

    def _queries(self, module, hidden_states, kwargs):
        q = get_prerope_query_states(module, hidden_states)  # [b, Hq, nq, d]
        nq = q.shape[2]
        last = kwargs["cache_position"].reshape(-1)[-1]
        pos = (last - nq + 1 + torch.arange(nq, device=q.device)).unsqueeze(0).expand(q.shape[0], -1)
        cos, sin = self._rotary(hidden_states, pos)
        return q * cos.unsqueeze(1) + rope_shift.rotate_half(q) * sin.unsqueeze(1)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        layer = module.layer_idx
        b, h, n, d = keys.shape
        q = self._queries(module, hidden_states, kwargs)
        hq, nq = q.shape[1], q.shape[2]
        g = hq // h
        scale = getattr(module, "scaling", d ** -0.5)
        s = torch.matmul(q.view(b, h, g, nq, d), keys.unsqueeze(2).transpose(-1, -2)).float() * scale
        qslot = n - nq + torch.arange(nq, device=keys.device)
        vis = torch.arange(n, device=keys.device)[None, :] <= qslot[:, None]  # [nq, n]
        p = s.masked_fill(~vis, float("-inf")).softmax(-1)  # [b, h, g, nq, n]
        st = {"max": p.amax(3), "min": p.masked_fill(~vis, float("inf")).amin(3).nan_to_num(posinf=0.0),
              "sum": p.sum(3)}
        for w in (8, 16, 32):
            st[f"w{w}"] = p[..., -w:, :].sum(3)
        if self._shifts is not None:  # the last 32 queries as if Δ tokens later (foresight.engine.cache.rope_shift)
            W = min(QUERY_WINDOW, nq)
            for name, table in zip(AHEAD_NAMES, self._shifts):
                qa = rope_shift.rotate(q[:, :, nq - W:], table).view(b, h, g, W, d)
                sa = torch.matmul(qa, keys.unsqueeze(2).transpose(-1, -2)).float() * scale
                st[name] = sa.masked_fill(~vis[nq - W:], float("-inf")).softmax(-1).sum(3)
        prev = self._state.get(layer)
        cum = torch.zeros(b, h, g, n, device=keys.device)
        dec = torch.zeros(b, h, g, n, device=keys.device)
        last = int(kwargs["cache_position"].reshape(-1)[-1])
        k = 0 if prev is None else prev[0].shape[-1]
        pos = (last - n + 1 + torch.arange(n, device=keys.device)).expand(b, h, n).clone()  # positions of new slots
        if prev is not None:
            cum[..., :k], dec[..., :k], pos[..., :k] = prev
        cum = cum + st["sum"]
        dec = DECAY * dec + st["sum"]
        st["cum"], st["decay"] = cum, dec
        with torch.no_grad():
            keep = -self.bank.forward_layer(layer, self.bank.assemble(keys, values, st, age=last - pos, token=pos))
        if self.protect_recent:
            keep[..., max(0, n - self.protect_recent):] = float("inf")
        keep = keep.to(keys.dtype)
        if self.compression_ratio > 0:  # carry the running sums in the order kvpress will keep the pairs
            idx = keep.topk(compute_n_kept(n, self.compression_ratio), dim=-1).indices  # ScorerPress's own rule
            gi = idx.unsqueeze(2).expand(b, h, g, idx.shape[-1])
            self._state[layer] = (cum.gather(-1, gi), dec.gather(-1, gi), pos.gather(-1, idx))
        return keep
