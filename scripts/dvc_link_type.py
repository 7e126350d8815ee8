"""Put reflink first in DVC's cache link types where this file system has it (``make setup``).

The tracked ``.dvc/config`` links with hardlinks (``hardlink,copy``): on ext4 a DVC that tries
reflink first falls back to copying on ``dvc add`` and on a stage's commit (measured: a 0.5 GB
checkpoint copied every iteration). Where reflinks work (XFS, btrfs, APFS) they are better still
(copy-on-write: a write through the workspace file cannot reach the cache), so this writes
``cache.type = reflink,copy`` to ``.dvc/config.local`` (machine-local, ignored by git). It prints
what it chose.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    dvc_dir = root / ".dvc"
    if not dvc_dir.is_dir():
        return 0
    with tempfile.TemporaryDirectory(dir=dvc_dir) as d:
        a, b = Path(d) / "a", Path(d) / "b"
        a.write_bytes(b"x" * 4096)
        ok = subprocess.run(["cp", "--reflink=always", str(a), str(b)], capture_output=True).returncode == 0
    local = dvc_dir / "config.local"
    if ok:
        local.write_text('[cache]\n    type = "reflink,copy"\n')
        print("dvc cache: reflink (copy-on-write) links")
    else:
        print("dvc cache: hardlinks (.dvc/config); this file system has no reflinks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
