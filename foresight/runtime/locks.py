"""One run per output folder: an exclusive lock held for the whole run of a stage that writes the folder.

The lock is the file ``OUT/.foresight.lock`` (created exclusively; it holds the holder's pid, host, stage and start
time) and is removed on any exit of the run. A lock left by a killed process is recognised by its pid (no such
process on this host) and taken over. In multi-process runs rank 0 holds it. A run that fails before writing anything
leaves no empty folder behind.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import json
import os
import socket
from pathlib import Path

from foresight.runtime import atomic

LOCK = ".foresight.lock"


class OutputBusyError(ValueError):
    """Another run holds the output folder."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(lock: Path) -> dict:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return {}


def _create(lock: Path, me: dict) -> bool:
    """Create ``lock`` holding ``me`` in one step: written aside, then hard-linked into place (which fails when it
    exists), so another run never reads a lock whose holder is not written yet. False when it exists. Where the
    file system has no hard links: exclusive creation, then the write."""
    tmp = lock.with_name(f"{lock.name}.{me['pid']}.tmp")
    tmp.write_text(json.dumps(me))
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    except OSError:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return True
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def output_lock(folder, stage: str):
    """Hold ``folder`` exclusively for the block (created if missing)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"output folder {folder} is a file")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "stage": stage,
          "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for _ in range(3):
        if not _create(lock, me):
            held = _holder(lock)
            if held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _alive(held["pid"]):
                lock.unlink(missing_ok=True)  # stale: its process was killed
                continue
            if not held:  # being written right now by another run (file systems without hard links)
                raise OutputBusyError(f"{folder} is in use by another foresight run ({lock})") from None
            raise OutputBusyError(f"{folder} is in use by `foresight {held.get('stage')}` (pid {held.get('pid')} on "
                                  f"{held.get('host')}, since {held.get('since')}); wait for it, or remove {lock} "
                                  "if that process is gone")
        atomic.clean_leftovers(folder)  # what killed runs left half-written; nobody else writes here now
        break
    else:
        raise OutputBusyError(f"{folder}: could not take the lock {lock}")
    ok = False
    try:
        yield folder
        ok = True
    finally:
        if _holder(lock).get("pid") == me["pid"]:
            lock.unlink(missing_ok=True)
        if not ok and created and folder.exists() and not any(folder.iterdir()):
            folder.rmdir()  # a failed run leaves no empty folder behind


def locks_output(stage: str, arg: str = "out"):
    """Decorator: the stage function holds its output folder (argument ``arg``) for its whole run (rank 0)."""

    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if int(os.environ.get("RANK", "0")) != 0:
                return fn(*args, **kwargs)
            with output_lock(sig.bind(*args, **kwargs).arguments[arg], stage):
                return fn(*args, **kwargs)

        return wrapper

    return deco
