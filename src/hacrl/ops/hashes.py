"""DVC's content hashes: what ``dvc.lock`` records for a file or a directory, computed here.

The input check compares a stage's inputs with them, tracking tags checkpoints and datasets with
them, and the external-input stages stamp inputs from outside the repository with them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def file_md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
