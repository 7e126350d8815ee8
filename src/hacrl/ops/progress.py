"""How long an iteration takes, for the terminal: an estimate of the time left when an iteration
starts, from the previous iteration's stages as they really ran.

Each stage run by ``hacrl stage`` (what ``dvc repro`` and the Prefect tasks call) adds its wall
time to ``runs/.timing.json``. It is not an artifact: DVC neither tracks nor restores it, so a
checkout or a stage DVC found up to date never writes a duration there, and nothing versioned
depends on the clock.
"""

from __future__ import annotations

import json
from pathlib import Path

TIMING = ".timing.json"


def _read(runs_dir: str | Path) -> dict:
    try:
        doc = json.loads((Path(runs_dir) / TIMING).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def record(runs_dir: str | Path, stage: str, t: int, wall_s: float) -> None:
    """Add ``stage``'s wall time of iteration ``t`` (a courtesy: a failure to write is ignored)."""
    from hacrl.storage import atomic_write_text

    doc = _read(runs_dir)
    doc.setdefault(str(t), {})[stage] = round(float(wall_s), 1)
    try:
        atomic_write_text(Path(runs_dir) / TIMING, json.dumps(doc, sort_keys=True) + "\n")
    except OSError:
        pass


def eta(runs_dir: str | Path, t: int, n: int, stages: tuple[str, ...]) -> str | None:
    """``iteration t/n: about M min left (iteration t-1 took S s)``, or None when iteration t-1
    has no complete record of ``stages`` (the first iteration, or one DVC did not run)."""
    prev = _read(runs_dir).get(str(t - 1), {})
    if t < 2 or not all(isinstance(prev.get(s), (int, float)) for s in stages):
        return None
    took = sum(prev[s] for s in stages)
    left = took * (n - t + 1)
    when = f"{left / 60:.0f} min" if left >= 90 else f"{left:.0f} s"
    return f"iteration {t}/{n}: about {when} left (iteration {t - 1} took {took:.0f} s)"
