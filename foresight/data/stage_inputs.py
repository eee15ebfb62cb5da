"""What a scorer-training stage starts from (SFT, GRPO, KVpop's training; the GRPO noise probe and the validation
references too): the device, the frozen LLM, the traces — refused when another model made them or their token ids lie
outside the model's vocabulary — and their train/validation split (the last ``sft.val_traces`` traces validate)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from foresight.runtime import distributed
from foresight.engine.models import load_model
from foresight.data.trace_data import load_traces


def split_traces(n: int, val: int) -> tuple[list[int], list[int]]:
    """Training and validation indices of ``n`` traces: the last ``val`` validate (at most a quarter)."""
    val = min(val, n // 4)
    return list(range(n - val)), list(range(n - val, n))


def check_traces_model(ds, traces_dir, model_cfg, model) -> None:
    """Refuse traces made by another model than the recipe's (``model_cfg``: its ``model`` section; the traces'
    ``meta.json`` names theirs) or holding token ids outside the model's vocabulary."""
    meta = Path(traces_dir) / "meta.json"
    if meta.exists():
        try:
            made = json.loads(meta.read_text())
        except ValueError as e:
            raise ValueError(f"{meta} is not valid JSON ({e})") from None
        if (made.get("model"), made.get("gguf_file")) != (model_cfg.path, model_cfg.gguf_file):
            raise ValueError(f"the traces in {traces_dir} were made by the model {made.get('model')!r}"
                             f"{' (' + made['gguf_file'] + ')' if made.get('gguf_file') else ''}, the recipe's model "
                             f"is {model_cfg.path!r}: make traces with this model (foresight traces)")
    vocab = model.get_input_embeddings().num_embeddings
    top = max(max(ids) for ids in ds["input_ids"])
    if top >= vocab:
        raise ValueError(f"the traces in {traces_dir} hold token id {top}, beyond the model's vocabulary of {vocab} "
                         "(another tokenizer?)")


def load_stage_inputs(cfg, model_cfg, traces_dir, world: int):
    """What a scorer-training stage starts from: the device, the frozen LLM, the traces and their train/validation
    split (the last ``sft.val_traces`` traces validate; ``sft.train_traces`` > 0 keeps the first that many of the
    others); clear errors for an indivisible batch or an empty dataset.
    ``cfg``, ``model_cfg``: the recipe's ``sft`` and ``model`` sections."""
    if cfg.batch_traces % world:
        raise ValueError(f"sft.batch_traces={cfg.batch_traces} must be divisible by the number of processes ({world})")
    device = distributed.local_device(model_cfg.device)
    torch.manual_seed(cfg.seed)
    model, _ = load_model(model_cfg, device=str(device))
    ds = load_traces(traces_dir)
    check_traces_model(ds, traces_dir, model_cfg, model)
    train_idx, val_idx = split_traces(len(ds), cfg.val_traces)
    if not train_idx:
        raise ValueError(f"no training traces in {traces_dir}")
    wanted = cfg.train_traces
    if wanted > len(train_idx):
        raise ValueError(f"sft.train_traces={wanted}, but {traces_dir} holds {len(train_idx)} training traces "
                         f"(and {len(val_idx)} validation ones)")
    if wanted > 0:
        train_idx = train_idx[:wanted]
    return device, model, ds, train_idx, val_idx
