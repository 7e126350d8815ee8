"""Atomic artifact writes and the run-directory layout.

Nothing a stage writes is ever visible under its final name until it is complete: files are
written to a temporary sibling and renamed, directories are built under a temporary name and
renamed. A killed stage therefore leaves only ``.tmp-*`` debris, which the next run removes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hacrl.errors import StorageFull

TMP_PREFIX = ".tmp-"
FAULT_ENV = "HACRL_FAULT"
"""Fault injection for the resume tests: ``kill-before-rename:NAME`` SIGKILLs the process when an
artifact named NAME is complete under its temporary name, i.e. in the middle of a stage's writes."""


def _fault_point(final: Path) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec.startswith("kill-before-rename:") and spec.split(":", 1)[1] == final.name:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _tmp_sibling(path: Path, is_dir: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if is_dir:
        return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{path.name}-", dir=path.parent))
    fd, name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}-", dir=path.parent)
    os.close(fd)
    return Path(name)


def _replace(tmp: Path, final: Path) -> None:
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)
    elif final.exists() or final.is_symlink():
        final.unlink()
    os.replace(tmp, final)


MANIFEST = "_artifact.json"
"""Inside every output directory of a stage: what the directory is (its path in the project, the
``dvc.yaml`` stage that wrote it, the iteration) and the files it holds with their sizes, written
with it (before the rename). A consumer checks it against the dependency it reads
(:func:`hacrl.ops.inputs.verify`): ``dvc.lock``'s hash says the content is what *some* stage
wrote, the manifest says which artifact it is."""


def manifest_of(root: Path, identity: dict) -> dict:
    """The manifest of directory ``root``: ``identity`` and ``files`` (relative path -> size)."""
    files = {f.relative_to(root).as_posix(): f.stat().st_size for f in sorted(root.rglob("*"))
             if f.is_file() and f.relative_to(root).as_posix() != MANIFEST}
    return {**identity, "files": files}


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, is_dir: bool = False, identity: dict | None = None) -> Iterator[Path]:
    """Yield a temporary path; on success it replaces ``path``, on error it is removed.
    ``identity`` (a directory's): written into it as its :data:`MANIFEST` before the rename."""
    final = Path(path)
    tmp = _tmp_sibling(final, is_dir)
    try:
        yield tmp
        if is_dir and identity is not None:
            (tmp / MANIFEST).write_text(json.dumps(manifest_of(tmp, identity), indent=1) + "\n")
        if is_dir:
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700 directories
        else:
            os.chmod(tmp, 0o644)
        _fault_point(final)
        _replace(tmp, final)
    except BaseException as e:
        written = _size(tmp)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        if out_of_space(e) and not isinstance(e, StorageFull):
            raise StorageFull(errno.ENOSPC, _full_message(final, written)) from e
        raise


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` is a disk or file-size limit running out: an ``OSError`` ENOSPC / EFBIG / EDQUOT,
    or torch's serializer saying so in its own words (``unexpected pos``: its writer stopped short)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("unexpected pos" in text or "No space left" in text
                                            or "File too large" in text)


def _size(p: Path) -> int:
    try:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
    except OSError:
        return 0


def _artifact(path: Path) -> Path:
    """The artifact a path is part of, as it will be named: ``data/.tmp-tasks-x1y2/train.jsonl``
    -> ``data/tasks/train.jsonl`` (a file written inside a directory being written)."""
    parts = [q[len(TMP_PREFIX):].rsplit("-", 1)[0] if q.startswith(TMP_PREFIX) else q for q in path.parts]
    return Path(*parts) if parts else path


def _full_message(final: Path, written: int) -> str:
    where = next((q for q in [final, *final.parents] if q.exists()), Path("."))
    final = _artifact(final)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = 0
    return (f"no space left writing {final} (the device of {where} has {free / 2**20:,.0f} MB free; "
            f"{written / 2**20:,.0f} MB were written before it ran out, or the file-size limit, ulimit -f, "
            f"was reached): free space or raise the limit, then run the stage again; nothing was renamed into place")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


TIMING_KEYS = frozenset({"seconds", "tokens_per_s"})
"""Wall-clock figures: returned by stages (MLflow logs them) but kept out of versioned files, so
that a rerun of a stage produces byte-identical artifacts."""


def without_timings(obj: Any) -> Any:
    """``obj`` with every key of :data:`TIMING_KEYS` removed, at any depth."""
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def clean_tmp(root: str | os.PathLike) -> int:
    """Remove debris that a killed stage left under ``root``; return how many were removed.

    Hidden directories are not looked into: they belong to processes that run beside the stages
    (``runs/.tracking``: the MLflow flusher, whose temporary file of the moment is no debris)."""
    n = 0
    root = Path(root)
    if not root.exists():
        return 0
    for p in list(root.rglob(f"{TMP_PREFIX}*")):
        if any(part.startswith(".") for part in p.relative_to(root).parts[:-1]):
            continue  # inside a hidden directory (or inside debris removed whole)
        if not p.exists():
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        n += 1
    return n


class RunLayout:
    """Where every versioned artifact of an experiment lives (what dvc.yaml declares)."""

    def __init__(self, runs_dir: str | os.PathLike = "runs", data_dir: str | os.PathLike = "data"):
        self.runs = Path(runs_dir)
        self.data = Path(data_dir)

    # preparation
    @property
    def tasks(self) -> Path:
        return self.data / "tasks"

    def it(self, t: int) -> Path:
        return self.runs / f"it{t}"

    # per iteration
    def checkpoints(self, t: int) -> Path:
        return self.it(t) / "checkpoints"

    def checkpoint(self, t: int, agent: str) -> Path:
        return self.checkpoints(t) / agent

    def train_state(self, t: int) -> Path:
        return self.it(t) / "train_state"

    def capability(self, t: int) -> Path:
        return self.it(t) / "capability.json"

    def rollouts(self, t: int) -> Path:
        return self.it(t) / "rollouts"

    def rewards(self, t: int) -> Path:
        return self.it(t) / "rewards"

    def exchange(self, t: int) -> Path:
        return self.it(t) / "exchange"

    def published(self, t: int, agent: str, record_type: str) -> Path:
        """An agent's published records of one type (SEE)."""
        return self.exchange(t) / "published" / agent / f"{record_type}.parquet"

    def learner_input(self, t: int, agent: str, record_type: str = "learner_input") -> Path:
        """A learner's subscription: its training rows, or one of its side tables."""
        return self.exchange(t) / "learners" / agent / f"{record_type}.parquet"

    def update_stats(self, t: int) -> Path:
        return self.it(t) / "update_stats.json"

    def eval_metrics(self, t: int) -> Path:
        return self.it(t) / "eval_metrics.json"

    def history(self, t: int) -> Path:
        return self.it(t) / "history.json"

    def evaluated(self, t: int) -> Path:
        """A constant stamp evaluate writes for iteration ``t``: the next iteration's rollouts
        depend on it, so that ``dvc repro`` evaluates each iteration before starting the next,
        while a change to the evaluation (its settings, its figures) leaves them up to date."""
        return self.it(t) / "evaluated.json"
