"""The scorer bank: one 2-layer MLP per (layer, KV head), all evaluated in one batched call; and its
standalone checkpoint.

Input per candidate (detached from the LLM): ``[key; value; attention statistics]`` — the key after the k-norm
and RoPE, the value, and the 8 statistics of :mod:`foresight.features` for each query head of the group.
Normalisation (the released code creates a LayerNorm and never uses it): statistics are compressed with
``log(x + 1e-6)`` (they are probabilities spanning orders of magnitude), then the whole input vector goes
through a LayerNorm with a learnable affine per (layer, KV head). Output: an eviction score per candidate
(higher = evict first). Parameters stay fp32 whatever the LLM's dtype.

Checkpoint folder: ``config.json`` (the LLM it belongs to, feature spec, B, L, sinks, stage, metrics) and
``model.safetensors`` (scorer weights only, never the LLM), plus a model card ``README.md``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from foresight import features as F
from foresight.policies.base import Policy

FORMAT_VERSION = 1
ACTIVATIONS = {"gelu": nn.functional.gelu, "relu": nn.functional.relu, "silu": nn.functional.silu,
               "tanh": torch.tanh}


class ScorerMismatchError(ValueError):
    """A scorer checkpoint does not fit the model it is used with."""


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
        bad = set(features) - {"key", "value", "attn"}
        if bad:
            raise ValueError(f"unknown scorer features {sorted(bad)}; known: key, value, attn")
        self.num_layers, self.kv_heads, self.head_dim, self.group = num_layers, kv_heads, head_dim, group
        self.hidden, self.activation, self.features = hidden, activation, tuple(features)
        d_in = F.feature_dim(head_dim, group, self.features)
        self.d_in = d_in
        g = torch.Generator().manual_seed(seed)
        self.ln_w = nn.Parameter(torch.ones(num_layers, kv_heads, d_in))
        self.ln_b = nn.Parameter(torch.zeros(num_layers, kv_heads, d_in))
        self.w1 = nn.Parameter(torch.randn(num_layers, kv_heads, d_in, hidden, generator=g) / math.sqrt(d_in))
        self.b1 = nn.Parameter(torch.zeros(num_layers, kv_heads, hidden))
        self.w2 = nn.Parameter(torch.randn(num_layers, kv_heads, hidden, generator=g) / math.sqrt(hidden))

    def inputs(self, view) -> torch.Tensor:
        """Detached fp32 scorer inputs [nl, b, h, n, D_in] from an :class:`~foresight.view.EvictionView`."""
        parts = []
        if "key" in self.features:
            parts.append(view.keys.detach().float())
        if "value" in self.features:
            parts.append(view.values.detach().float())
        if "attn" in self.features:
            parts.append(torch.log(view.attn_features().detach().float() + 1e-6))
        return torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = nn.functional.layer_norm(x, (self.d_in,))
        x = x * self.ln_w[:, None, :, None, :] + self.ln_b[:, None, :, None, :]
        hdn = torch.einsum("lbhnd,lhdk->lbhnk", x, self.w1) + self.b1[:, None, :, None, :]
        hdn = ACTIVATIONS[self.activation](hdn)
        return torch.einsum("lbhnk,lhk->lbhn", hdn, self.w2)

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
                "features": list(self.features), "stats": list(F.STAT_NAMES), "d_in": self.d_in,
                "normalisation": "log(stats+1e-6), layernorm + affine per (layer, kv head)"}


class LearnedPolicy(Policy):
    """Eviction by a trained :class:`ScorerBank` (higher score = evict first)."""

    name = "learned"

    def __init__(self, bank: ScorerBank, label: str = "foresight"):
        self.bank, self.name = bank, label
        self.reads = None if "attn" in bank.features else frozenset()  # a key/value-only scorer needs no attention

    @torch.no_grad()
    def score(self, view):
        p = next(self.bank.parameters())
        return self.bank(self.bank.inputs(view).to(p.device)).to(view.keys.device)


def bank_for_model(model, hidden: int = 16, activation: str = "gelu", features=("key", "value", "attn"),
                   seed: int = 0) -> ScorerBank:
    from foresight.models import describe

    d = describe(model)
    return ScorerBank(d["num_layers"], d["num_key_value_heads"], d["head_dim"],
                      d["num_attention_heads"] // d["num_key_value_heads"], hidden, activation, features, seed)


# ------------------------------------------------------------------------------------------------ checkpoint
def save_scorer(bank: ScorerBank, out: Path, model_info: dict, budget: int, interval: int, sinks: int, stage: str,
                metrics: dict | None = None, extra: dict | None = None) -> Path:
    """Write the standalone checkpoint into ``out`` (other files there, e.g. a run's logs, are left alone).

    Each file is written aside and renamed into place; the weights go first and ``config.json`` last, so a
    folder with a config always has matching weights."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "format": "foresight-scorer", "format_version": FORMAT_VERSION, "stage": stage,
        "llm": model_info, "scorer": bank.spec(), "budget": budget, "interval": interval, "sinks": sinks,
        "metrics": metrics or {}, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    tmp = out / f"model.safetensors.tmp{os.getpid()}"
    save_file({k: v.detach().float().contiguous().cpu() for k, v in bank.state_dict().items()}, str(tmp))
    os.replace(tmp, out / "model.safetensors")
    for name, text in (("README.md", model_card(cfg)), ("config.json", json.dumps(cfg, indent=1))):
        tmp = out / f"{name}.tmp{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return out


def record_eval(path: Path, rows: list[dict], method: str) -> None:
    """Store a checkpoint's evaluation rows in its config.json and model card (atomic rewrites)."""
    path = Path(path)
    cfg = read_config(path)
    cfg["eval"] = [r for r in rows if r["method"] == method]
    for name, text in (("README.md", model_card(cfg)), ("config.json", json.dumps(cfg, indent=1))):
        tmp = path / f"{name}.tmp{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, path / name)


def read_config(path: Path) -> dict:
    path = Path(path)
    f = path / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"no scorer checkpoint at {path} (config.json missing)")
    cfg = json.loads(f.read_text())
    if cfg.get("format") != "foresight-scorer":
        raise ScorerMismatchError(f"{f} is not a foresight scorer checkpoint")
    return cfg


def check_compatible(cfg: dict, model) -> None:
    """Refuse a checkpoint whose LLM shape differs from ``model``'s, naming every mismatch."""
    from foresight.models import describe

    have = describe(model)
    want = cfg["llm"]
    diffs = [f"{k}: checkpoint {want.get(k)} vs model {have[k]}"
             for k in ("num_layers", "num_attention_heads", "num_key_value_heads", "head_dim") if want.get(k) != have[k]]
    if diffs:
        raise ScorerMismatchError(f"scorer checkpoint was trained for another model ({want.get('name_or_path')}): "
                                  + "; ".join(diffs))


def is_kvpop(spec: dict) -> bool:
    """Whether a checkpoint's ``scorer`` spec holds KVpop scorers (``kind``; ForesightKV banks have none)."""
    return str(spec.get("kind", "foresight")).startswith("kvpop")


def load_scorer(path: Path, model=None, device="cpu") -> tuple[ScorerBank, dict]:
    """A checkpoint's scorers (a ForesightKV :class:`ScorerBank`, or a KVpop scorer when ``scorer.kind`` says so)
    and its config; with ``model``, refuse a checkpoint made for another model."""
    cfg = read_config(path)
    if model is not None:
        check_compatible(cfg, model)
    s = cfg["scorer"]
    if is_kvpop(s):
        from foresight.kvpop.scorers import build_from_spec

        bank = build_from_spec(s)
    else:
        bank = ScorerBank(s["num_layers"], s["num_key_value_heads"], s["head_dim"], s["group"], s["hidden"],
                          s["activation"], tuple(s["features"]))
    state = load_file(str(Path(path) / "model.safetensors"))
    if "b2" in state and "b2" not in bank.state_dict():
        state.pop("b2")  # older checkpoints: a per-head output bias, which no eviction decision depends on
    missing = set(bank.state_dict()) ^ set(state)
    if missing:
        raise ScorerMismatchError(f"scorer weights in {path} do not match its config (tensors {sorted(missing)})")
    bank.load_state_dict(state)
    return bank.to(device).eval(), cfg


def method_name(cfg: dict) -> str:
    """How evaluations name a checkpoint: ``foresight-<stage>`` (sft, grpo) or the KVpop stage itself."""
    return cfg["stage"] if is_kvpop(cfg["scorer"]) else f"foresight-{cfg['stage']}"


def policy_from_checkpoint(bank, cfg: dict, label: str | None = None) -> Policy:
    """The eviction policy that runs a loaded checkpoint's scorers inside the cache."""
    label = label or method_name(cfg)
    if is_kvpop(cfg["scorer"]):
        from foresight.kvpop.scorers import KVpopPolicy

        return KVpopPolicy(bank, label)
    return LearnedPolicy(bank, label)


def _eval_table(rows) -> str:
    if not rows:
        return "Not evaluated yet: run `foresight eval --scorers <this folder>`."
    head = "| B:L | prompt kept | loss ratio | accuracy | recall@L |\n|---|---|---|---|---|\n"
    return head + "".join(f"| {r['budget']}:{r['interval']} | {r['protect_prompt']} | {r['loss_ratio']} | "
                          f"{r['accuracy']} | {r['recall_at_L']} |\n" for r in rows)


def model_card(cfg: dict) -> str:
    m = cfg.get("metrics") or {}
    sc = cfg["scorer"]
    if is_kvpop(sc):
        title = "KVpop eviction scorers (future-attention target, boundary loss)"
        layout = (f"KVpop layout: {sc['sinks']} sinks + window {sc['window']} + top-k by priority (decay γ = "
                  f"{sc['gamma']} every {sc['decay_step']} tokens)")
        arch = f"{sc['kind']}{' (delayed read-out)' if sc.get('delayed') else ''}, input [key; value]"
    else:
        title = "ForesightKV eviction scorers"
        layout = f"sinks = {cfg['sinks']}"
        arch = f"MLPs, input {sc['d_in']} ([key; value; attention statistics])"
    rows = "\n".join(f"| {k} | {v} |" for k, v in m.items()) or "| (none recorded) | |"
    llm = cfg["llm"]
    return f"""# {title} ({cfg['stage']})

Learned KV-cache eviction scorers trained with [foresight](https://github.com/) for a frozen LLM.

- **LLM:** `{llm.get('name_or_path')}` ({llm.get('model_type')}, {llm.get('num_layers')} layers,
  {llm.get('num_attention_heads')} query / {llm.get('num_key_value_heads')} KV heads, head dim {llm.get('head_dim')})
- **Budget:** B = {cfg['budget']} pairs per (sequence, layer, KV head), eviction every L = {cfg['interval']} tokens,
  {layout}
- **Stage:** {cfg['stage']}
- **Training data:** {cfg.get('training_data', 'see config.json')}
- **Scorer:** {sc['num_layers']}×{sc['num_key_value_heads']} {arch}, hidden {sc['hidden']},
  {sc['activation']}

## Metrics

| metric | value |
|---|---|
{rows}

## Evaluation (`foresight eval`)

{_eval_table(cfg.get("eval"))}

## Use

```python
from foresight.integrations.hf import ForesightCache
cache = ForesightCache.from_pretrained("<this folder>", model, budget={cfg['budget']}, interval={cfg['interval']})
out = model.generate(input_ids, cache=cache, max_new_tokens=...)
```
"""
