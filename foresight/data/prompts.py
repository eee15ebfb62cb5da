"""Prompt sources and answer checkers for the data stage and the evaluation.

* ``task.kind = ledger``: the synthetic generator of ``data_prep/ledger.py`` (prompt i is drawn from seed
  ``traces.seed * 1_000_003 + i``; held-out problems start at ``traces.heldout_offset``), checked by its own
  checker.
* ``task.kind = math``: a ``datasets`` dataset (local json/jsonl/parquet/csv, or a hub name where a hub is
  reachable) with a prompt column and an answer column; answers are checked by ``\\boxed{}`` extraction and
  normalisation.
* ``task.kind = none``: a dataset with a prompt column only; traces are kept by length alone.
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import torch

from data_prep import ledger

MATH_INSTRUCTION = "Please solve the following problem step by step and put the final answer within \\boxed{}."


@dataclasses.dataclass
class Prompt:
    index: int
    messages: list  # chat messages (user, optionally system)
    answer: str | None
    input_ids: list[int] | None = None  # pre-tokenised prompt (synthetic task)


def encode(prompt: Prompt, tokenizer) -> list[int]:
    """A prompt's token ids: pre-tokenised (the synthetic task), or its chat messages through the tokenizer's chat
    template with the generation prompt."""
    if prompt.input_ids is not None:
        return list(prompt.input_ids)
    enc = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def pad_rows(rows: list[list[int]], pad_token_id: int, device, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as one batch padded on the ``left`` (prompts to generate from) or the ``right``
    (traces to teacher-force): (ids [b, P], attention mask [b, P], 0 = padding)."""
    P = max(map(len, rows))
    pads = [[pad_token_id] * (P - len(r)) for r in rows]
    ids = [p + r if side == "left" else r + p for p, r in zip(pads, rows)]
    mask = [[0] * len(p) + [1] * len(r) if side == "left" else [1] * len(r) + [0] * len(p) for p, r in zip(pads, rows)]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def ledger_spec(task) -> ledger.LedgerSpec:
    return ledger.LedgerSpec(task.facts, task.variables, task.filler, task.scratch)


def heldout_prompts(task, traces, count: int, tokenizer=None) -> list["Prompt"]:
    """The first ``count`` held-out prompts: synthetic seeds from ``traces.heldout_offset``; for a dataset with a
    ``split`` column its first ``heldout`` rows, whatever the number of training prompts used (traces from the first
    64 of 264 training rows are evaluated on the same held-out rows as traces from all of them); else the rows after
    the training prompts. None is an error. ``task``, ``traces``: the recipe's sections."""
    start = traces.heldout_offset if traces.prompt_dataset is None else first_heldout_row(traces)
    problems = load_prompts(task, traces, start, count, tokenizer, split="heldout")
    if not problems:
        raise ValueError(f"no held-out problems: the prompt dataset has no rows after the first {start}")
    return problems


def first_heldout_row(traces) -> int:
    """Where a prompt dataset's held-out rows begin: its first ``split == heldout`` row when it has a ``split``
    column, else right after the ``traces.num_prompts`` training rows (``traces``: the recipe's section)."""
    ds = load_prompt_dataset(traces.prompt_dataset, traces.prompt_split)
    if "split" not in ds.column_names:
        return traces.num_prompts
    return next((i for i, s in enumerate(ds["split"]) if s == "heldout"), len(ds))


def training_rows(traces_cfg, start: int, count: int) -> list[int]:
    """The prompt rows of training prompts ``start .. start+count-1`` (``traces_cfg``: the recipe's ``traces``
    section): for a dataset with a ``split`` column its ``train`` rows in file order, past any held-out block (a file
    may hold more training rows after its held-out ones); else the rows themselves."""
    if traces_cfg.prompt_dataset is None:
        return list(range(start, start + count))
    ds = load_prompt_dataset(traces_cfg.prompt_dataset, traces_cfg.prompt_split)
    if "split" not in ds.column_names:
        return list(range(start, min(start + count, len(ds))))
    train = [i for i, s in enumerate(ds["split"]) if s == "train"]
    if start + count > len(train):
        raise ValueError(f"prompt dataset {traces_cfg.prompt_dataset!r} has {len(train)} training rows; "
                         f"traces.num_prompts asks for {start + count}")
    return train[start:start + count]


def load_prompts(task, traces_cfg, start: int, count: int, tokenizer=None, split: str | None = None) -> list[Prompt]:
    """Prompts ``start .. start+count-1`` of the prompt source of a recipe's ``task`` and ``traces`` sections (rows
    past the end are left out). ``split`` (``train`` or ``heldout``): when the dataset has a ``split`` column, every
    row read must carry that value (reading held-out rows as training ones, or the reverse, is an error)."""
    return load_rows(task, traces_cfg, range(start, start + count), tokenizer, split)


def load_rows(task, traces_cfg, rows, tokenizer=None, split: str | None = None) -> list[Prompt]:
    """The prompts at ``rows`` (indices into the prompt source, ascending) of a recipe's ``task`` and ``traces``
    sections; ``split`` as in :func:`load_prompts`."""
    rows = list(rows)
    if traces_cfg.prompt_dataset is None:
        if task.kind != "ledger":
            raise ValueError(f"task.kind={task.kind!r} needs traces.prompt_dataset (a path or a hub name)")
        spec = ledger_spec(task)
        out = []
        for i in rows:
            p = ledger.make_problem(spec, random.Random(traces_cfg.seed * 1_000_003 + i))
            out.append(Prompt(i, [{"role": "user", "content": ledger.prompt_text(p)}], p.answer, p.prompt_ids))
        return out
    ds = load_prompt_dataset(traces_cfg.prompt_dataset, traces_cfg.prompt_split)
    cols = set(ds.column_names)
    if traces_cfg.prompt_column not in cols:
        raise ValueError(f"prompt dataset {traces_cfg.prompt_dataset!r} has no column {traces_cfg.prompt_column!r} "
                         f"(columns: {', '.join(sorted(cols))}); set traces.prompt_column")
    need_answer = task.kind in ("math", "ledger")
    if need_answer and traces_cfg.answer_column not in cols:
        raise ValueError(f"prompt dataset {traces_cfg.prompt_dataset!r} has no answer column {traces_cfg.answer_column!r} "
                         f"(columns: {', '.join(sorted(cols))}); set traces.answer_column or task.kind=none")
    if len(ds) == 0:
        raise ValueError(f"prompt dataset {traces_cfg.prompt_dataset!r} is empty")
    out = []
    for i in (i for i in rows if i < len(ds)):
        row = ds[i]
        if split is not None and "split" in cols and row["split"] != split:
            raise ValueError(f"prompt dataset {traces_cfg.prompt_dataset!r}: row {i} is a {row['split']!r} prompt, read "
                             f"as {split!r}")
        text = str(row[traces_cfg.prompt_column])
        if task.kind == "math":
            text = f"{text}\n{task.instruction or MATH_INSTRUCTION}"
        msgs = ([{"role": "system", "content": task.system_prompt}] if task.system_prompt else [])
        msgs.append({"role": "user", "content": text})
        out.append(Prompt(i, msgs, str(row[traces_cfg.answer_column]) if need_answer else None))
    return out


def load_prompt_dataset(name: str, split: str = "train"):
    import datasets

    p = Path(name)
    if p.exists():
        if p.is_dir() and (p / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(p))
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        ext = p.suffix.lstrip(".")
        kind = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(ext)
        if kind is None:
            raise ValueError(f"prompt dataset {name!r}: unsupported file type {ext!r} (json, jsonl, parquet, csv)")
        return datasets.load_dataset(kind, data_files=str(p), split="train")
    if name.startswith((".", "/")) or name.endswith((".json", ".jsonl", ".parquet", ".csv")):
        raise FileNotFoundError(f"prompt dataset file not found: {name}")
    return datasets.load_dataset(name, split=split)


# ------------------------------------------------------------------------------------------------ checking
def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0:
        return None
    depth = 0
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k]
    return None


def normalise_answer(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|:)", "", s)
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace(" ", "")
    s = re.sub(r"\^\{\\circ\}|\^\\circ|°", "", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        f = float(s)
        if f == int(f):
            return str(int(f))
        return repr(f)
    except ValueError:
        return s


def math_correct(text: str, answer: str) -> bool:
    got = extract_boxed(text)
    return got is not None and normalise_answer(got) == normalise_answer(extract_boxed(answer) or answer)


def check(task, solution_ids: list[int], text: str, answer: str | None) -> bool | None:
    """Correctness of one generated solution under the recipe's ``task`` (None when the task is not checkable)."""
    kind = task.kind
    if kind == "ledger":
        return ledger.check(solution_ids, answer, ledger_spec(task))
    if kind == "math":
        return math_correct(text, answer)
    return None
