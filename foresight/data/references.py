"""Full-cache reference traces of held-out prompts (what evaluation teacher-forces every method on), and their
batches.

Generated in batches (left-padded, ``traces.batch_size`` prompts at a time; sampled rows are seeded per prompt, so a
row's random draws do not depend on the batch it ran in, though its logits do in the last bits — padding and batched
matrix products — and in bfloat16 a sampled row can take another token somewhere and diverge (138 of 192 SmolLM2
references changed when generated again in batches of 96 rather than the earlier batches). Compare methods on one
evaluation's references, which the cache keeps), then scored by one batched full-cache pass (right-padded: every row
sees exactly its own tokens). Each reference is cached on disk under ``$FORESIGHT_CACHE/references`` (default
``~/.cache/foresight``), keyed by the model's files, the recipe fields that shape a trace and the prompt, so a
second evaluation of the same held-out set reuses it. Teacher-forced batches (:func:`trace_batches`) group traces of
similar length, padded on the right (:func:`make_batch`), so each row's evictions fall where they fall alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from foresight.data import prompts

from foresight.runtime import atomic
from foresight.engine.generate import Decoding, GenerateOptions, generate
from foresight.engine.models import resolve_path
from foresight.engine.rollout import rollout


def cache_dir() -> Path:
    return Path(os.environ.get("FORESIGHT_CACHE", Path.home() / ".cache" / "foresight")) / "references"


def model_fingerprint(model_cfg) -> dict:
    """The model's identity: its location, revision and dtype, plus the size and time of its local weight files."""
    path, gguf = resolve_path(model_cfg.path, model_cfg.gguf_file)
    files = []
    p = Path(path)
    if p.is_dir():
        for f in sorted(p.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".gguf", ".json") and (gguf is None or f.suffix != ".gguf"
                                                                           or f.name == gguf):
                st = f.stat()
                files.append([f.name, st.st_size, st.st_mtime_ns])
    return {"path": str(path), "gguf": gguf, "revision": model_cfg.revision, "dtype": model_cfg.dtype, "files": files}


def reference_key(task, tr, do_sample: bool, prompt_ids: list[int], seed: int, model: dict) -> str:
    """A hash of everything a reference trace depends on: the recipe's ``task`` and ``traces`` (``tr``) sections,
    ``eval.do_sample``, the prompt, the seed and ``model`` (its :func:`model_fingerprint`)."""
    blob = {"model": model, "task": dict(vars(task)), "prompt": prompt_ids,
            "sampling": [tr.max_new_tokens, do_sample, tr.temperature, tr.top_k, tr.top_p, seed]
            + ([tr.min_tokens] if tr.min_tokens else [])}  # keys made before min_tokens existed stay valid
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:32]


@torch.no_grad()
def reference_traces(recipe, model, tok, problems, device, use_cache: bool = True, log=print,
                     progress: bool = False) -> list[dict]:
    """One dict per problem: ``ids`` [1, S], ``prompt_len``, full-cache ``loss`` and ``entropy`` [S], ``correct``.
    ``progress``: a bar over the references not in the cache, advancing as each generation batch finishes."""
    seed = recipe.eval.seed
    rows = [prompts.encode(p, tok) for p in problems]
    fingerprint = model_fingerprint(recipe.model)  # one look at the model's files for all prompts
    keys = [reference_key(recipe.task, recipe.traces, recipe.eval.do_sample, r, seed * 1_000_003 + p.index, fingerprint)
            for r, p in zip(rows, problems)]
    refs: list[dict | None] = [None] * len(problems)
    if use_cache:
        for i, k in enumerate(keys):
            f = cache_dir() / f"{k}.json"
            if f.exists():
                d = json.loads(f.read_text())
                refs[i] = {"ids": torch.tensor([d["ids"]], device=device), "prompt_len": d["prompt_len"],
                           "loss": torch.tensor(d["loss"], device=device),
                           "entropy": torch.tensor(d["entropy"], device=device), "correct": d["correct"]}
    todo = [i for i, r in enumerate(refs) if r is None]
    if len(todo) < len(problems):
        log(f"[eval] {len(problems) - len(todo)} of {len(problems)} reference traces from the cache ({cache_dir()})")
    decoding = Decoding.from_recipe(recipe.traces, tok, do_sample=recipe.eval.do_sample)
    bs = max(1, recipe.traces.batch_size)
    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc="references", unit="trace", disable=not (progress and todo))
    for b0 in range(0, len(todo), bs):
        part = todo[b0:b0 + bs]
        ids, mask = prompts.pad_rows([rows[i] for i in part], tok.pad_token_id, device)
        gens = [torch.Generator(device=device).manual_seed(seed * 1_000_003 + problems[i].index) for i in part]
        out = generate(model, ids, mask, max_new_tokens=recipe.traces.max_new_tokens, decoding=decoding,
                       options=GenerateOptions(row_generators=gens if decoding.do_sample else None))
        news = [decoding.truncate(n) for n in out.new_tokens.tolist()]
        seqs = [rows[i] + n for i, n in zip(part, news)]
        full_ids, full_mask = prompts.pad_rows(seqs, tok.pad_token_id, device, side="right")
        full = rollout(model, full_ids, attention_mask=full_mask)
        for j, i in enumerate(part):
            S = len(seqs[j])
            ok = prompts.check(recipe.task, news[j], tok.decode(news[j], skip_special_tokens=True), problems[i].answer)
            refs[i] = {"ids": torch.tensor([seqs[j]], device=device), "prompt_len": len(rows[i]),
                       "loss": full.token_loss[j, :S].clone(), "entropy": full.token_entropy[j, :S].clone(),
                       "correct": ok}
            if use_cache:
                atomic.write_json(cache_dir() / f"{keys[i]}.json",
                                  {"ids": seqs[j], "prompt_len": len(rows[i]), "loss": refs[i]["loss"].tolist(),
                                   "entropy": refs[i]["entropy"].tolist(), "correct": ok})
        bar.update(len(part))
    bar.close()
    return refs


def trace_batches(refs: list[dict], batch_size: int, by_prompt: bool, spread: float = 1.25) -> list[list[int]]:
    """Reference indices per teacher-forced batch: sorted by length, at most ``batch_size`` each, the longest at most
    ``spread`` × the shortest (bounded padding), one prompt length per batch when ``by_prompt`` (prompt protection
    needs it)."""
    def key(i):
        return (refs[i]["prompt_len"] if by_prompt else 0, refs[i]["ids"].shape[1], i)

    out, cur = [], []
    for i in sorted(range(len(refs)), key=key):
        if cur and (len(cur) == batch_size or refs[i]["ids"].shape[1] > spread * refs[cur[0]]["ids"].shape[1]
                    or key(i)[0] != key(cur[0])[0]):
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


def make_batch(refs: list[dict], members: list[int], pad_token_id: int) -> dict:
    """References as one right-padded batch: every row sees exactly its own tokens, and evictions fall at the same
    positions as when it runs alone (pads only follow a row's end)."""
    seqs = [refs[i]["ids"][0].tolist() for i in members]
    dev = refs[members[0]]["ids"].device
    ids, mask = prompts.pad_rows(seqs, pad_token_id, dev, side="right")
    mask = mask.bool()
    S = ids.shape[1]

    def padded(name):
        return torch.stack([torch.nn.functional.pad(refs[i][name], (0, S - refs[i][name].shape[0])) for i in members])

    return {"members": members, "ids": ids, "mask": mask, "lengths": [len(x) for x in seqs],
            "prompt_lens": [refs[i]["prompt_len"] for i in members], "loss": padded("loss"),
            "entropy": padded("entropy")}


def stack_padded(tensors: list[torch.Tensor], dims: tuple[int, ...]) -> torch.Tensor:
    """Stack per-trace tensors, zero-padded at the end of the dimensions ``dims`` to the largest size."""
    size = {d: max(t.shape[d] for t in tensors) for d in dims}
    out = []
    for t in tensors:
        pad = []
        for d in reversed(range(t.dim())):
            pad += [0, size[d] - t.shape[d] if d in size else 0]
        out.append(torch.nn.functional.pad(t, pad))
    return torch.stack(out)
