"""Is DVC at work in this workspace? A stage run by hand must not write under a running
``dvc repro`` (it would rewrite the outputs DVC is about to record, and remove the running
stage's temporary files).

DVC holds its repository lock (``.dvc/tmp/lock``, an ``flock``) while it plans and records, and
releases it while a stage's command runs; then its read/write locks (``.dvc/tmp/rwlock``, JSON
naming the process) say which outputs that command writes. Either one, held by a live process,
means DVC is at work. A stage run by hand holds the repository lock itself while it runs, so a
``dvc repro`` started meanwhile stops at once ("Unable to acquire lock") instead of racing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from hacrl.errors import ConfigError


class WorkspaceBusy(ConfigError):
    """DVC is running in this workspace (exit 2: running the same stage again now cannot help)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rwlock_holders(tmp: Path) -> list[str]:
    """``PID: command`` of the live processes DVC's read/write locks name."""
    try:
        doc = json.loads((tmp / "rwlock").read_text())
    except (OSError, ValueError):
        return []
    infos = [*doc.get("write", {}).values(), *[i for v in doc.get("read", {}).values() for i in v]]
    return list(dict.fromkeys(f"{i['pid']}: {i.get('cmd', '?')}" for i in infos
                              if isinstance(i, dict) and isinstance(i.get("pid"), int) and _alive(i["pid"])))


@contextlib.contextmanager
def hold_dvc_lock(project: str | os.PathLike) -> Iterator[None]:
    """Hold DVC's repository lock for a stage run by hand; raise :class:`WorkspaceBusy` when DVC
    holds it, or its read/write locks name a live process. No ``.dvc/``: nothing to hold."""
    tmp = Path(project) / ".dvc" / "tmp"
    if not tmp.parent.is_dir():
        yield
        return
    tmp.mkdir(exist_ok=True)
    busy = "stage run by hand while DVC is at work in this workspace ({}); it would rewrite what DVC " \
           "records: wait for it to finish, or run the stage through DVC (`dvc repro STAGE`)"
    fd = os.open(tmp / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkspaceBusy(busy.format(f"{tmp / 'lock'} is held")) from None
        holders = _rwlock_holders(tmp)
        if holders:
            raise WorkspaceBusy(busy.format("a stage runs: " + "; ".join(holders)))
        yield
    finally:
        os.close(fd)  # releases the lock


def repair_rwlock(project: str | os.PathLike) -> str | None:
    """Remove DVC's read/write-lock file when a killed ``dvc`` left it unreadable; return what was
    done, or None.

    DVC rewrites ``.dvc/tmp/rwlock`` in place (truncate, then write the JSON), under its
    ``rwlock.lock``: a ``dvc`` killed between the two leaves it empty or cut, and every later
    ``dvc`` command then fails ("Unable to read RWLock-file ... JSON structure is corrupted") until
    someone removes it (seen under ``kill -9`` at random moments). Holding ``rwlock.lock`` as DVC
    does (an ``flock``), a file that is still not JSON is removed: it names no lock anyone can
    hold, since its writer is dead. A live DVC holding ``rwlock.lock`` is left alone."""
    tmp = Path(project) / ".dvc" / "tmp"
    path = tmp / "rwlock"

    def unreadable() -> bool:
        try:
            json.loads(path.read_text() or "x")
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            return True
        return False

    if not unreadable():
        return None
    fd = os.open(tmp / "rwlock.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # DVC is editing it right now
        if not unreadable():
            return None
        path.unlink()
    finally:
        os.close(fd)
    return (f"removed {path.relative_to(Path(project))}: DVC's read/write-lock file was not readable (a dvc "
            f"process killed while writing it); DVC starts a new one")
