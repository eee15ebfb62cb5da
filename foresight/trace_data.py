"""A traces dataset on disk (what ``foresight traces`` writes): reading it with checks, for every stage that uses it.

Record fields: ``input_ids`` (prompt + solution, EOS included), ``prompt_len``, ``answer``, ``correct``,
``token_loss`` and ``token_entropy`` (aligned with ``input_ids``; index t is about predicting token t, index 0
is 0), ``prompt_index``, ``num_new_tokens``, ``text`` (the decoded solution).
"""

from __future__ import annotations

from pathlib import Path


class TraceDataError(ValueError):
    """A trace folder or file is malformed or belongs to another recipe."""


REQUIRED = ("input_ids", "prompt_len", "token_loss", "token_entropy")


def load_traces(path: str | Path, limit: int | None = None):
    """Load a traces dataset (``OUT`` or ``OUT/dataset``), checking that it is well formed."""
    import datasets

    p = Path(path)
    if (p / "dataset").exists():
        p = p / "dataset"
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
