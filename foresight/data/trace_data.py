"""A traces dataset on disk (what ``foresight traces`` writes): reading it with checks, for every stage that uses it.

Record fields: ``input_ids`` (prompt + solution, EOS included), ``prompt_len``, ``answer``, ``correct``,
``token_loss`` and ``token_entropy`` (aligned with ``input_ids``; index t is about predicting token t, index 0
is 0), ``prompt_index``, ``num_new_tokens``, ``text`` (the decoded solution).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Callable


class TraceDataError(ValueError):
    """A trace folder or file is malformed or belongs to another recipe."""


def _versions(folder: Path) -> list[tuple[int, Path]]:
    out = []
    for p in folder.glob("dataset.v*"):
        m = re.fullmatch(r"dataset\.v(\d+)", p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def publish(folder: Path, save: Callable[[str], None]) -> Path:
    """Replace ``folder/dataset`` with what ``save(path)`` writes, so that a reader (or a kill at any point) sees the
    old dataset or the new one, never neither: the new one is written aside, renamed to ``dataset.vN``, and
    ``dataset`` (a symbolic link) is switched to it in one rename; older versions are removed after."""
    folder = Path(folder)
    tmp = folder / f".dataset.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save(str(tmp))
    final = folder / "dataset"
    if final.is_dir() and not final.is_symlink():  # a folder from before versions: it becomes version 0
        os.rename(final, folder / "dataset.v0")
    k = max((v for v, _ in _versions(folder)), default=-1) + 1
    os.rename(tmp, folder / f"dataset.v{k}")
    link = folder / f".dataset.link-{os.getpid()}"
    link.unlink(missing_ok=True)
    os.symlink(f"dataset.v{k}", link)
    os.replace(link, final)
    for v, p in _versions(folder):
        if v != k:
            shutil.rmtree(p, ignore_errors=True)
    return final


def dataset_path(path: Path) -> Path:
    """The dataset folder of a traces folder (``OUT/dataset``, or its newest complete version if a run was killed
    while switching), or ``path`` itself."""
    if (path / "dataset").exists():
        return path / "dataset"
    versions = _versions(path)
    return versions[-1][1] if versions else path


REQUIRED = ("input_ids", "prompt_len", "token_loss", "token_entropy")


def load_traces(path: str | Path, limit: int | None = None):
    """Load a traces dataset (``OUT`` or ``OUT/dataset``), checking that it is well formed."""
    import datasets

    p = dataset_path(Path(path))
    if not p.exists():
        raise TraceDataError(f"traces not found at {path}: run `foresight traces --out {path}` first")
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds
        raise TraceDataError(f"{p} is not a traces dataset: {e}") from None
    missing = [c for c in REQUIRED if c not in ds.column_names]
    if missing:
        raise TraceDataError(f"trace dataset {p} lacks column(s) {', '.join(missing)}")
    if len(ds) == 0:
        raise TraceDataError(f"trace dataset {p} is empty")
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    for i, r in enumerate(ds):
        n = len(r["input_ids"])
        if len(r["token_loss"]) != n or len(r["token_entropy"]) != n or not 0 < r["prompt_len"] < n:
            raise TraceDataError(f"trace {i} of {p} is malformed: input_ids, token_loss and token_entropy must have "
                                 f"equal lengths and 0 < prompt_len < length")
    return ds


def fingerprint(ids) -> str:
    """A short content hash of a token sequence (a list of ints or an integer tensor): the same tokens give the same
    string on every machine, whatever folder the trace was read from."""
    return hashlib.blake2b(",".join(str(int(t)) for t in ids).encode(), digest_size=8).hexdigest()


def training_fingerprints(ds, indices, init: dict | None = None) -> dict:
    """What a scorer checkpoint records of the traces it was trained on: the fingerprints of the rows ``indices`` of
    ``ds`` (``traces``) and of their prompts (``prompts``), united with those its initialisation's config records
    (``init``: a GRPO run's SFT scorer), so an evaluation can tell whether its references were among them."""
    rows = ds.select(indices) if len(indices) else []
    traces = {fingerprint(r["input_ids"]) for r in rows}
    prompts = {fingerprint(r["input_ids"][:r["prompt_len"]]) for r in rows}
    seen = (init or {}).get("training_traces") or {}
    return {"traces": sorted(traces | set(seen.get("traces", []))),
            "prompts": sorted(prompts | set(seen.get("prompts", [])))}
