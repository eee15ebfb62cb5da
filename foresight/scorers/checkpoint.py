"""The standalone scorer checkpoint, one format for both scorer families: ForesightKV's :class:`ScorerBank`
(:mod:`foresight.scorers.bank`) and KVpop's scorers (:mod:`foresight.scorers.kvpop`).

Checkpoint folder: ``config.json`` (the LLM it belongs to, the scorer spec, B, L, sinks, stage, metrics, and
after ``foresight eval`` its evaluation rows), ``model.safetensors`` (scorer weights only, fp32, never the LLM),
plus a model card ``README.md``. The spec's ``kind`` (absent for ForesightKV banks) says which scorer it holds;
:data:`KINDS` maps each kind to how its scorer is rebuilt from the spec and the policy that runs it in the cache.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from foresight.runtime import atomic
from foresight.scorers.kvpop import KVpopPolicy, build_from_spec
from foresight.engine.models import describe
from foresight.policies.base import Policy
from foresight.scorers.bank import LearnedPolicy, ScorerBank

FORMAT_VERSION = 1


class ScorerMismatchError(ValueError):
    """A scorer checkpoint does not fit the model it is used with."""


def _foresight_bank(spec: dict) -> ScorerBank:
    return ScorerBank(spec["num_layers"], spec["num_key_value_heads"], spec["head_dim"], spec["group"], spec["hidden"],
                      spec["activation"], tuple(spec["features"]))


# scorer kind -> (the scorer module rebuilt from the config's ``scorer`` spec, the policy class that runs it)
KINDS = {
    "foresight": (_foresight_bank, LearnedPolicy),
    "kvpop-mlp": (build_from_spec, KVpopPolicy),
    "kvpop-mlstm": (build_from_spec, KVpopPolicy),
}


def scorer_kind(spec: dict) -> str:
    """A checkpoint's scorer kind (a key of :data:`KINDS`; ForesightKV banks have no ``kind`` in their spec)."""
    return str(spec.get("kind", "foresight"))


def is_kvpop(spec: dict) -> bool:
    """Whether a checkpoint's ``scorer`` spec holds KVpop scorers."""
    return scorer_kind(spec).startswith("kvpop")


def _kind(cfg: dict, where: str = "the checkpoint") -> tuple:
    kind = scorer_kind(cfg["scorer"])
    if kind not in KINDS:
        raise ScorerMismatchError(f"{where} holds scorers of unknown kind {kind!r}; known: {', '.join(KINDS)}")
    return KINDS[kind]


@dataclasses.dataclass(frozen=True)
class CheckpointExtras:
    """What :func:`save_scorer` writes beyond the scorer and the cache it was trained for: the stage's ``metrics``
    (config.json's ``metrics``), ``extra`` keys merged into config.json, and ``weights``: the bank's full state dict
    when the bank itself may hold only a partition of it (default: ``bank.state_dict()``)."""

    metrics: dict | None = None
    extra: dict | None = None
    weights: dict | None = None


def save_scorer(bank: torch.nn.Module, out: Path, model_info: dict, budget: int, interval: int, sinks: int,
                stage: str, extras: CheckpointExtras = CheckpointExtras()) -> Path:
    """Write the standalone checkpoint of ``bank`` (a :class:`ScorerBank` or a KVpop scorer) into ``out`` (other
    files there, e.g. a run's logs, are left alone): the LLM ``model_info`` (:func:`describe`), the cache's
    ``budget``, ``interval`` and ``sinks``, the training ``stage`` and the :class:`CheckpointExtras`.

    Each file is written aside and renamed into place; the weights go first and ``config.json`` last, so a
    folder with a config always has matching weights."""
    metrics, extra, weights = extras.metrics, extras.extra, extras.weights
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "format": "foresight-scorer", "format_version": FORMAT_VERSION, "stage": stage,
        "llm": model_info, "scorer": bank.spec(), "budget": budget, "interval": interval, "sinks": sinks,
        "metrics": metrics or {}, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    weights = {k: v.detach().float().contiguous().cpu() for k, v in (weights or bank.state_dict()).items()}
    atomic.replace(out / "model.safetensors", lambda tmp: save_file(weights, tmp))
    _write_config(out, cfg)
    return out


def _write_config(path: Path, cfg: dict) -> None:
    """The model card, then ``config.json`` (each replaced atomically)."""
    atomic.write_text(path / "README.md", model_card(cfg))
    atomic.write_json(path / "config.json", cfg, indent=1)


def record_eval(path: Path, rows: list[dict], method: str) -> None:
    """Store a checkpoint's evaluation rows in its config.json and model card (atomic rewrites)."""
    path = Path(path)
    cfg = read_config(path)
    cfg["eval"] = [r for r in rows if r["method"] == method]
    _write_config(path, cfg)


def read_config(path: Path) -> dict:
    path = Path(path)
    f = path / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"no scorer checkpoint at {path} (config.json missing)")
    try:
        cfg = json.loads(f.read_text())
    except ValueError as e:
        raise ScorerMismatchError(f"{f} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("format") != "foresight-scorer":
        raise ScorerMismatchError(f"{f} is not a foresight scorer checkpoint")
    return cfg


def check_compatible(cfg: dict, model) -> None:
    """Refuse a checkpoint whose LLM shape differs from ``model``'s, naming every mismatch."""
    have = describe(model)
    want = cfg["llm"]
    diffs = [f"{k}: checkpoint {want.get(k)} vs model {have[k]}"
             for k in ("num_layers", "num_attention_heads", "num_key_value_heads", "head_dim") if want.get(k) != have[k]]
    if diffs:
        raise ScorerMismatchError(f"scorer checkpoint was trained for another model ({want.get('name_or_path')}): "
                                  + "; ".join(diffs))


def load_scorer(path: Path, model=None, device="cpu") -> tuple[torch.nn.Module, dict]:
    """A checkpoint's scorers (a ForesightKV :class:`ScorerBank`, or the KVpop scorer its ``scorer.kind`` names)
    and its config; with ``model``, refuse a checkpoint made for another model."""
    cfg = read_config(path)
    if model is not None:
        check_compatible(cfg, model)
    build, _ = _kind(cfg, str(path))
    bank = build(cfg["scorer"])
    try:
        state = load_file(str(Path(path) / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own kinds for a damaged file
        raise ScorerMismatchError(f"cannot read the scorer weights {Path(path) / 'model.safetensors'}: {e}") from None
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


def policy_from_checkpoint(bank, cfg: dict, label: str | None = None, precision: str = "float32") -> Policy:
    """The eviction policy that runs a loaded checkpoint's scorers inside the cache (``precision``: of a ForesightKV
    bank's first product, :data:`foresight.scorers.bank.PRECISIONS`; float32 gives the trained scores exactly)."""
    _, policy = _kind(cfg)
    if policy is LearnedPolicy:
        return policy(bank, label or method_name(cfg), precision)
    if precision != "float32":
        raise ValueError(f"scorer precision {precision!r} applies to ForesightKV scorers; this checkpoint holds "
                         f"{scorer_kind(cfg['scorer'])!r} scorers")
    return policy(bank, label or method_name(cfg))


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
    # scalars only: per-step histories stay in config.json / metrics.json
    rows = "\n".join(f"| {k} | {v} |" for k, v in m.items() if not isinstance(v, (list, dict))) or "| (none recorded) | |"
    llm = cfg["llm"]
    return f"""# {title} ({cfg['stage']})

Learned KV-cache eviction scorers for a frozen LLM, trained with foresight (a re-implementation of ForesightKV,
[arXiv 2602.03203](https://arxiv.org/abs/2602.03203)).

- **LLM:** `{llm.get('path') or llm.get('name_or_path')}` ({llm.get('model_type')}, {llm.get('num_layers')} layers,
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
from foresight import ForesightCache
cache = ForesightCache.from_pretrained("<this folder>", model, budget={cfg['budget']}, interval={cfg['interval']})
out = model.generate(input_ids, cache=cache, max_new_tokens=...)
```
"""
