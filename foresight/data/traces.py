"""The data stage (``foresight traces``): a frozen model writes reasoning traces; correct, long ones are kept
with their full-cache per-token loss and entropy (what the GRPO reward needs).

Pipeline per batch of prompts: generation (``traces.engine``: ``hf`` batched in this process, seeded, greedy or the
recipe's sampling; ``openai`` by an OpenAI-compatible server, see :mod:`foresight.data.completions`) → check the
answer → keep correct traces with at least ``traces.min_new_tokens`` generated tokens → one chunked
teacher-forced full-cache pass per kept trace (``traces.loss_chunk`` tokens of logits at a time, never the
full sequence × vocabulary) → the batch's records are written atomically as one part file.

Resumable: a part file exists only once its batch is complete (a rerun skips finished batches, never duplicates a
trace). Processes (one per GPU) take batch i on rank ``i % world``; rank 0 merges. Seeds depend on the batch index
only, so the data does not depend on the number of processes.

Output folder::

    OUT/recipe.json      the recipe that made it (a different recipe is refused)
    OUT/parts/*.json     per-batch records (kept for resume)
    OUT/completions/     per-prompt server completions (engine openai; kept for resume)
    OUT/dataset/         the merged datasets.Dataset (save_to_disk)
    OUT/meta.json        model, tokenizer, recipe, seed, date, counts, throughput

The record fields, and the reader every later stage uses, are in :mod:`foresight.data.trace_data`.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from foresight.data import prompts

from foresight.runtime import atomic, distributed
from foresight.data.completions import RemoteGenerator
from foresight.engine.generate import Decoding, GenerateOptions, generate
from foresight.runtime.locks import locks_output
from foresight.engine.models import load_model
from foresight.engine.rollout import RolloutOptions, rollout
from foresight.data.trace_data import TraceDataError, publish

TRACE_SECTIONS = ("model", "task", "traces")
# how the traces are fetched, not what they are: may change between runs into one folder
TRANSPORT_FIELDS = ("num_prompts", "base_url", "server_model", "api_key_env", "concurrency", "request_timeout",
                    "max_retries", "score_during_decoding")


def recipe_key(recipe) -> dict:
    d = recipe.to_dict()
    key = {s: dict(d[s]) for s in TRACE_SECTIONS}
    for f in TRANSPORT_FIELDS:  # num_prompts: more prompts extend the same data
        key["traces"].pop(f)
    return key


def check_out_dir(out: Path, recipe) -> None:
    """Refuse an output folder that holds another recipe's traces; record ours otherwise."""
    out.mkdir(parents=True, exist_ok=True)
    rec = out / "recipe.json"
    key = recipe_key(recipe)
    if rec.exists():
        try:
            old = json.loads(rec.read_text())
        except json.JSONDecodeError:
            raise TraceDataError(f"{rec} is not valid JSON; is {out} a traces folder?") from None
        for field, before in (("engine", "hf"), ("min_tokens", 0)):  # folders made before these fields existed
            old.get("key", {}).get("traces", {}).setdefault(field, before)
        if old.get("key") != key:
            diff = sorted(f"{s}.{k}" for s in key for k in key[s] if old.get("key", {}).get(s, {}).get(k) != key[s][k])
            raise TraceDataError(f"output folder {out} holds traces of another recipe (differs in: "
                                 f"{', '.join(diff) or 'sections'}); use a new --out")
    else:
        atomic.write_json(rec, {"recipe": recipe.name, "key": key})


@locks_output("traces")
def make_traces(recipe, out: Path, progress: bool = True, log=print) -> dict:
    out = Path(out)
    rank, world = distributed.rank_world()
    if rank == 0:
        check_out_dir(out, recipe)
    distributed.barrier()
    if rank != 0:
        check_out_dir(out, recipe)
    parts = out / "parts"
    parts.mkdir(exist_ok=True)
    traces_cfg = recipe.traces
    if traces_cfg.num_prompts <= 0:
        raise ValueError(f"traces.num_prompts must be > 0, got {traces_cfg.num_prompts}")
    n_batches = (traces_cfg.num_prompts + traces_cfg.batch_size - 1) // traces_cfg.batch_size
    done = finished(out, traces_cfg, n_batches)
    if done is not None:  # nothing to decode, score or merge: the folder (its dataset and meta.json) stays as it is
        log(f"[traces] {out}: finished ({done['num_traces']} traces of {traces_cfg.num_prompts} prompts)")
        return {"kept_this_run": 0, "generated_tokens_this_run": 0, "seconds_this_run": 0.0,
                **({"requests_this_run": 0} if traces_cfg.engine == "openai" else {}),
                "num_traces": done["num_traces"], "length": done["length"]}
    device = distributed.local_device(recipe.model.device)
    model, tok = load_model(recipe.model, device=str(device))
    mine = [i for i in range(n_batches) if i % world == rank]
    todo = [i for i in mine if not part_file(out, traces_cfg, i).exists()]
    if len(todo) < len(mine):
        log(f"[traces] resuming: {len(mine) - len(todo)} of {len(mine)} batches already done")
    from tqdm import tqdm

    size, train_rows = traces_cfg.batch_size, prompts.training_rows(traces_cfg, 0, traces_cfg.num_prompts)
    batches = {bi: prompts.load_rows(recipe.task, traces_cfg, train_rows[bi * size:(bi + 1) * size], tok, split="train")
               for bi in todo}
    remote, t0 = None, time.time()  # the clock covers the decoding a server does before the first batch is scored
    if traces_cfg.engine == "openai":
        remote = RemoteGenerator(traces_cfg, recipe.model, tok, out / "completions", log=log)
        sent = remote.start([batches[bi] for bi in todo])
        log(f"[traces] {sent} prompts sent to {remote.client.base_url} ({traces_cfg.concurrency} in flight); "
            f"{sum(map(len, batches.values())) - sent} completions already on disk")
        if not traces_cfg.score_during_decoding:
            remote.wait(progress)
    bar = tqdm(total=len(todo), desc=f"traces[rank{rank}]", disable=not progress, unit="batch")
    kept = gen_tokens = 0
    try:
        for bi in todo:
            batch = batches[bi]
            rows = [prompts.encode(p, tok) for p in batch]
            if remote is None:
                news = generate_batch(traces_cfg, model, tok, rows, seed=traces_cfg.seed * 7919 + bi, device=device)
            else:
                news = remote.tokens(batch)
            records, n_new = keep_and_score(recipe.task, traces_cfg, model, tok, batch, rows, news, device)
            atomic.write_json(part_file(out, traces_cfg, bi), records)
            kept += len(records)
            gen_tokens += n_new
            bar.update(1)
            bar.set_postfix(kept=kept, tok_s=f"{gen_tokens / max(time.time() - t0, 1e-9):.0f}")
    finally:
        if remote is not None:
            remote.close()
    bar.close()
    elapsed = time.time() - t0
    distributed.barrier()
    summary = {"kept_this_run": kept, "generated_tokens_this_run": gen_tokens, "seconds_this_run": round(elapsed, 2)}
    if remote is not None:
        summary.update(requests_this_run=remote.requests, max_in_flight=remote.max_in_flight)
    if rank == 0:
        old = json.loads((out / "meta.json").read_text()).get("throughput") if (out / "meta.json").exists() else None
        summary.update(merge(out, recipe, n_batches, model, tok, remote))
        summary["traces_per_minute"] = round(kept / max(elapsed, 1e-9) * 60, 2) if kept else 0.0
        meta = json.loads((out / "meta.json").read_text())
        meta["throughput"] = summary if (todo or old is None) else old  # a rerun that only merges keeps the measured one
        atomic.write_json(out / "meta.json", meta)
    distributed.barrier()
    return summary


def generate_batch(traces_cfg, model, tok, rows: list[list[int]], seed: int, device) -> list[list[int]]:
    """In-process generation (``traces.engine: hf``) under the recipe's ``traces`` section: each row's generated
    tokens, up to and including its EOS."""
    ids, mask = prompts.pad_rows(rows, tok.pad_token_id, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    decoding = Decoding.from_recipe(traces_cfg, tok)
    res = generate(model, ids, mask, max_new_tokens=traces_cfg.max_new_tokens, decoding=decoding,
                   options=GenerateOptions(generator=gen))
    return [decoding.truncate(new) for new in res.new_tokens.tolist()]


def keep_and_score(task, traces_cfg, model, tok, batch: list, rows: list, news: list, device) -> tuple[list, int]:
    """Check each generated row (``task``: the recipe's section), keep the correct and long ones (``traces_cfg``:
    its ``traces`` section), and score them with a full-cache pass; -> (records, generated tokens). The same for
    every engine."""
    records, n_new = [], 0
    vocab = model.get_output_embeddings().weight.shape[0]
    for p, row, new in zip(batch, rows, news):
        n_new += len(new)
        if any(not 0 <= t < vocab for t in new):
            raise TraceDataError(f"prompt {p.index}: generated token ids outside the model's vocabulary of {vocab} "
                                 "(was it made by another model?)")
        text = tok.decode(new, skip_special_tokens=True)
        correct = prompts.check(task, new, text, p.answer)
        if traces_cfg.require_correct and correct is False:
            continue
        if len(new) < traces_cfg.min_new_tokens:
            continue
        seq = torch.tensor([row + new], device=device)
        full = rollout(model, seq, policy=None, options=RolloutOptions(chunk=traces_cfg.loss_chunk))
        records.append({
            "prompt_index": p.index, "input_ids": row + new, "prompt_len": len(row), "answer": p.answer or "",
            "correct": correct, "num_new_tokens": len(new), "text": text,
            "token_loss": [round(x, 6) for x in full.token_loss[0].tolist()],
            "token_entropy": [round(x, 6) for x in full.token_entropy[0].tolist()],
        })
    return records, n_new


def finished(out: Path, traces_cfg, n_batches: int) -> dict | None:
    """The folder's meta.json when its published dataset holds every batch: every part file exists, none is newer
    than the dataset, and it was merged for the same number of prompts; None otherwise."""
    state, meta_file = out / "dataset" / "state.json", out / "meta.json"
    files = [part_file(out, traces_cfg, bi) for bi in range(n_batches)]
    if not (state.exists() and meta_file.exists() and all(f.exists() for f in files)):
        return None
    meta = json.loads(meta_file.read_text())
    if meta.get("num_prompts") != traces_cfg.num_prompts or "num_traces" not in meta:
        return None
    return meta if max(f.stat().st_mtime for f in files) <= state.stat().st_mtime else None


def part_file(out: Path, traces_cfg, bi: int) -> Path:
    """Batch ``bi``'s part file, named by the prompts it covers (a batch cut short by an earlier, smaller
    ``traces.num_prompts`` is not mistaken for the full one); ``traces_cfg``: the recipe's ``traces`` section."""
    size, n = traces_cfg.batch_size, traces_cfg.num_prompts
    return Path(out) / "parts" / f"prompts-{bi * size:07d}-{min((bi + 1) * size, n):07d}.json"


def merge(out: Path, recipe, n_batches: int, model, tok, remote=None) -> dict:
    """Merge the part files into ``OUT/dataset`` (written aside, then switched in atomically: see
    :func:`foresight.data.trace_data.publish`)."""
    import datasets

    rows = []
    for bi in range(n_batches):
        f = part_file(out, recipe.traces, bi)
        if not f.exists():
            raise TraceDataError(f"missing part file {f}: a process did not finish; run the same command again")
        try:
            rows.extend(json.loads(f.read_text()))
        except ValueError:
            raise TraceDataError(f"part file {f} is not valid JSON (a torn write?): delete it and run the same "
                                 "command again") from None
    rows.sort(key=lambda r: r["prompt_index"])
    if not rows:
        raise TraceDataError(f"no trace was kept out of {recipe.traces.num_prompts} prompts (all wrong or shorter "
                             f"than traces.min_new_tokens={recipe.traces.min_new_tokens}); nothing to save")
    publish(out, lambda tmp: datasets.Dataset.from_list(rows).save_to_disk(tmp))
    lengths = [len(r["input_ids"]) for r in rows]
    meta = {
        "model": recipe.model.path, "gguf_file": recipe.model.gguf_file, "revision": recipe.model.revision,
        "model_class": type(model).__name__, "tokenizer": type(tok).__name__, "recipe": recipe.to_dict(),
        "recipe_name": recipe.name, "seed": recipe.traces.seed,
        "engine": remote.describe() if remote is not None else {"engine": "hf"},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "num_traces": len(rows), "num_prompts": recipe.traces.num_prompts,
        "length": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
    }
    atomic.write_json(out / "meta.json", meta)
    return {"num_traces": len(rows), "length": meta["length"]}
