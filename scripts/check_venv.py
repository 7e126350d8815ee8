"""Refuse a virtual environment made for another checkout (a workspace copied with ``cp -a``).

Such a ``.venv`` imports hacrl from the other checkout's ``src/`` (the editable install points
there) and its scripts start the other directory's Python: tests and stages would run the other
code. Run by ``make setup`` with any Python; exit 1 with one line when the venv is foreign.
"""

import json
import sys
import urllib.parse
import urllib.request
from pathlib import Path


def owner(venv: Path) -> Path | None:
    """The checkout the venv's editable hacrl install points at (None: not installed yet)."""
    for f in sorted(venv.glob("lib/python*/site-packages/hacrl-*.dist-info/direct_url.json")):
        url = json.loads(f.read_text()).get("url", "")
        if url.startswith("file:"):
            return Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path)).resolve()
    return None


def main(venv: str = ".venv") -> int:
    here = Path.cwd().resolve()
    other = owner(Path(venv))
    if other is not None and other != here:
        print(f"hacrl: error: {venv} was made for {other} (it imports that checkout's code): this directory was "
              f"copied; remove {venv} (rm -rf {venv}) and run make again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
