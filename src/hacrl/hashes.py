"""Content hashes: what ``dvc.lock`` records for a file or a directory, computed here, and the
fingerprint of the code a long-lived process serves.

The input check compares a stage's inputs with them, tracking tags checkpoints and datasets with
them, the external-input stages stamp inputs from outside the repository with them, and the
engine host names the weights an engine serves by them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

MEMO = Path(".dvc") / "tmp" / "hacrl-md5.json"
"""Per project: each file's md5 keyed by its (size, mtime, ctime, inode)."""


def file_digest(path: Path, algorithm: str = "md5") -> str:
    """The hex digest of a file's bytes, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def file_md5(path: Path) -> str:
    return file_digest(path, "md5")


def dvc_hash(path: str | os.PathLike, md5=file_md5) -> str:
    """The md5 DVC records for ``path``: a file's md5, or the ``<md5>.dir`` of a directory
    (``md5``: how a file's md5 is had, e.g. through a cache)."""
    p = Path(path)
    if p.is_file():
        return md5(p)
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.meta import Meta
    from dvc_data.hashfile.tree import Tree

    tree = Tree()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        tree.add(f.relative_to(p).parts, Meta(size=f.stat().st_size), HashInfo("md5", md5(f)))
    tree.digest()
    return tree.hash_info.value


def cached_dvc_hash(project: str | os.PathLike, path: str | os.PathLike) -> str:
    """DVC's hash of ``path``, each file's md5 memoised by (size, mtime, ctime, inode) in the
    project's ``.dvc/tmp/hacrl-md5.json`` (no memo without ``.dvc/``): a stage start stats its
    inputs instead of reading them again (DVC hashed them a moment ago). Any write to a file
    changes its ctime, which no tool sets."""
    memo_file = Path(project) / MEMO
    use_memo = memo_file.parent.parent.is_dir()
    try:
        memo = json.loads(memo_file.read_text()) if use_memo and memo_file.is_file() else {}
    except (OSError, ValueError):
        memo = {}
    seen = {}
    dvc_state = _DvcState(project) if use_memo else None

    def md5_of(f: Path) -> str:
        st = f.stat()
        key = str(f.resolve())
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        hit = memo.get(key)
        if hit and hit[0] == stamp:
            seen[key] = hit
            return hit[1]
        md5 = dvc_state.md5(f) if dvc_state is not None else None
        seen[key] = [stamp, md5 or file_md5(f)]
        return seen[key][1]

    try:
        h = dvc_hash(path, md5=md5_of)
    finally:
        if dvc_state is not None:
            dvc_state.close()
    if use_memo and seen and any(memo.get(k) != v for k, v in seen.items()):
        memo.update(seen)
        try:  # temp file, then rename: a reader never sees half a memo
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=memo_file.parent, prefix=".hacrl-md5.")
            with os.fdopen(fd, "w") as f:
                json.dump(memo, f)
            os.replace(tmp, memo_file)
        except OSError:  # a memo only
            pass
    return h


class _DvcState:
    """DVC's own record of the files it hashed (its state database: md5 by inode, mtime and
    size), opened on the first file our memo misses. A stage's outputs were hashed by DVC when
    it committed them (and linked them into its cache, which changes their ctime, so our memo
    misses); reading DVC's record instead of hashing again halves the hashing of every output
    (at 8B, ~110 GB of recovery state per agent and iteration). A file DVC has no current record
    of (written or edited since: another mtime or size) is hashed here."""

    def __init__(self, project: str | os.PathLike):
        self.project = Path(project)
        self.repo = None
        self.failed = False

    def md5(self, f: Path) -> str | None:
        if self.failed:
            return None
        try:
            if self.repo is None:
                from dvc.repo import Repo

                self.repo = Repo(str(self.project))
            _, info = self.repo.state.get(os.path.abspath(f), self.repo.fs)
        except Exception:  # noqa: BLE001 - a cache only: hash the file ourselves
            self.failed = True
            return None
        value = getattr(info, "value", None)
        return value if value and getattr(info, "name", "md5") == "md5" and not value.endswith(".dir") else None

    def close(self) -> None:
        if self.repo is not None:
            try:
                self.repo.close()
            except Exception:  # noqa: BLE001
                pass


def code_fingerprint() -> str:
    """Changes when any hacrl source file or the set of installed packages changes: a process
    that serves this code (the stage server, the engine host) stops serving once it differs."""
    import site

    import hacrl

    h = hashlib.sha1()
    pkg = Path(hacrl.__file__).parent
    for f in sorted(pkg.rglob("*.py")):
        st = f.stat()
        h.update(f"{f}:{st.st_mtime_ns}:{st.st_size}".encode())
    for d in site.getsitepackages():
        if os.path.isdir(d):
            h.update(f"{d}:{os.stat(d).st_mtime_ns}".encode())
    return h.hexdigest()
