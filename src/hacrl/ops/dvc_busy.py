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
def _flocked(path: Path) -> Iterator[bool]:
    """Try DVC's kind of lock on ``path`` (an ``flock``, as zc.lockfile takes it) without waiting:
    yields whether this process holds it; released on exit."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


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
    with _flocked(tmp / "lock") as held:
        if not held:
            raise WorkspaceBusy(busy.format(f"{tmp / 'lock'} is held"))
        holders = _rwlock_holders(tmp)
        if holders:
            raise WorkspaceBusy(busy.format("a stage runs: " + "; ".join(holders)))
        yield


LOCK_COPY = Path(".dvc") / "tmp" / "hacrl-dvc.lock"
"""The last complete ``dvc.lock``, copied by each stage DVC starts (see :func:`keep_lock_copy`)."""


def _lock_state(path: Path) -> str | None:
    """Why ``path`` (a dvc.lock) is not one DVC can read, or None (a readable or absent one)."""
    import yaml

    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        return str(e)
    if not text.strip():
        return "empty"
    try:
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader
    except yaml.YAMLError:
        return "not valid YAML"
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA  # DVC's own check: what it would refuse
    from voluptuous import Invalid

    try:
        COMPILED_LOCKFILE_SCHEMA(doc)
    except Invalid as e:
        return f"cut short ({e})"
    return None


def keep_lock_copy(project: str | os.PathLike) -> None:
    """Copy ``dvc.lock`` to :data:`LOCK_COPY` (atomically) when a stage DVC runs starts: DVC wrote
    it whole before starting the stage, and rewrites it in place (truncate, then write) when the
    stage ends, so a dvc killed at that moment empties it; :func:`repair_after_kill` restores
    this copy then. A courtesy: a failure to copy is ignored."""
    from hacrl.storage import atomic_write_text

    src = Path(project) / "dvc.lock"
    try:
        text = src.read_text()
        if text.strip() and "stages:" in text:
            atomic_write_text(Path(project) / LOCK_COPY, text)
    except OSError:
        pass


def _restore_lock(project: Path) -> str | None:
    path = project / "dvc.lock"
    why = _lock_state(path)
    if why is None:
        return None
    copy = project / LOCK_COPY
    if not copy.is_file() or _lock_state(copy) is not None:
        return (f"dvc.lock is {why} (a dvc killed while writing it?) and no copy of it is kept here: "
                f"`git checkout dvc.lock` restores the committed one")
    from hacrl.storage import atomic_write_text

    with _flocked(project / ".dvc" / "tmp" / "lock") as held:
        if not held or _lock_state(path) is None:
            return None  # DVC is at work (writing it right now), or it was repaired meanwhile
        atomic_write_text(path, copy.read_text())
    return (f"dvc.lock was {why} (a dvc killed while writing it): restored the copy taken when the last stage "
            f"started; the stage DVC was recording runs again")


def repair_after_kill(project: str | os.PathLike) -> list[str]:
    """Repair what a ``dvc`` killed while writing left unreadable: its read/write-lock file
    (:func:`repair_rwlock`) and ``dvc.lock`` (restored from :data:`LOCK_COPY`). Returns what was
    done or found, one line each."""
    return [x for x in (repair_rwlock(project), _restore_lock(Path(project))) if x]


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
    with _flocked(tmp / "rwlock.lock") as held:
        if not held or not unreadable():
            return None  # DVC is editing it right now, or it was repaired meanwhile
        path.unlink()
    return (f"removed {path.relative_to(Path(project))}: DVC's read/write-lock file was not readable (a dvc "
            f"process killed while writing it); DVC starts a new one")
