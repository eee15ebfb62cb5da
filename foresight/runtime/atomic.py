"""Atomic file replacement: every finished artefact is written aside (a unique temporary name in the same folder)
and renamed into place in one step, so a reader, or a run killed mid-write, sees the old file or the new one, never
a torn one."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def replace(path: str | Path, write: Callable[[str], None]) -> Path:
    """Create or replace ``path`` with what ``write(tmp_path)`` writes to a temporary file beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return replace(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path: str | Path, obj, indent: int | None = None) -> Path:
    return write_text(path, json.dumps(obj, indent=indent))


def torch_save(obj, path: str | Path) -> Path:
    import torch

    return replace(path, lambda tmp: torch.save(obj, tmp))


_LEFTOVER = re.compile(r"(^\..+\.tmp$)|(^\.[^.]+\.(tmp|link)-\d+$)|(\.tmp\d*$)")


def clean_leftovers(folder: str | Path, depth: int = 2) -> list[Path]:
    """Remove the temporary files and folders that killed runs left in ``folder`` (and its subfolders, ``depth``
    levels): names written aside before a rename. Call only while holding the folder (see foresight.runtime.locks)."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if _LEFTOVER.search(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
        elif depth > 1 and p.is_dir() and not p.is_symlink():
            removed += clean_leftovers(p, depth - 1)
    return removed
