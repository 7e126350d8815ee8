"""The finished runs kept with a setting's report: ``reports/<suite>/<setting>/runs/``, one gzipped
JSON file per run (a few kB, committed). They are the report's raw data (``results.json`` lists
them by reference) and what ``hacrl compare --resume`` reuses on a fresh checkout (the scratch
directory holds checkpoints and is not kept). Tuning runs are kept here too."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

from hacrl.errors import ConfigError
from hacrl.storage import atomic_path, read_json

log = logging.getLogger(__name__)

STORE_DIR = "runs"


def store_file(store: Path, name: str, seed: int) -> Path:
    """Where run ``name`` (a contender, or ``tune/<contender>/<point>``) with ``seed`` is kept."""
    return store / f"{name.replace('/', '__').replace(' ', '_')}__seed{seed}.json.gz"


def store_run(store: Path, name: str, seed: int, run: dict) -> None:
    """Keep a finished run (its curves, overrides and pool) in the store, atomically."""
    store.mkdir(parents=True, exist_ok=True)
    with atomic_path(store_file(store, name, seed)) as tmp:
        # no name, mtime 0 in the gzip header: the same run gives the same bytes; keys in their
        # order (the pool's agent order is the report's panel and table order)
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write((json.dumps(run) + "\n").encode())


def stored_run(store: Path, name: str, seed: int) -> dict | None:
    """A kept run, or None (also for a file that cannot be read: the run is done again)."""
    f = store_file(store, name, seed)
    if not f.exists():
        return None
    try:
        with gzip.open(f, "rt") as fh:
            return json.load(fh)
    except (OSError, EOFError, ValueError) as e:  # damaged, or a git-LFS pointer
        log.warning("%s cannot be read (%s): the run is done again", f, e)
        return None


def run_refs(results: list[dict], setting_dir: Path) -> list[dict]:
    """What ``results.json`` lists for ``results``: each run's contender, seed and store file (the
    run itself stays in the store, once). A run not in the store yet is put there."""
    store = setting_dir / STORE_DIR
    refs = []
    for r in results:
        f = store_file(store, r["contender"], r["seed"])
        if not f.exists():
            store_run(store, r["contender"], r["seed"], r)
        refs.append({"contender": r["contender"], "seed": r["seed"], "file": f.relative_to(setting_dir).as_posix()})
    return refs


def load_results(setting_dir: Path) -> dict:
    """``setting_dir/results.json`` with its runs read back from the store. A report written before
    the store existed (pre-protocol) holds its runs inline; they are returned as they are."""
    res = read_json(setting_dir / "results.json")
    runs = []
    for r in res["runs"]:
        if "file" not in r:
            runs.append(r)
            continue
        run = stored_run(setting_dir / STORE_DIR, r["contender"], r["seed"])
        if run is None:
            raise ConfigError(f"{setting_dir / r['file']}: the run results.json lists is missing or unreadable")
        runs.append(run)
    return {**res, "runs": runs}
