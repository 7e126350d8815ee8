"""Stage records on their way to MLflow: queued by the stage, logged by one background process.

Importing MLflow and opening its SQLAlchemy store cost about 3 s per stage process, as much as
some stages' work. So a stage that finishes (or fails) writes its record, a small JSON file, to
``runs/.tracking/queue/`` (atomically: a reader never sees half a record) and starts a detached
flusher; the stage process exits at once. A flusher takes ``runs/.tracking/flush.lock``
(blocking), logs every queued record in the order they were queued and deletes each once
MLflow has it, so two flushers never log the same record twice, and one started after a record
was queued always finds it. A record MLflow refuses moves to ``queue/failed/`` with the reason
in ``runs/.tracking/flush.log``; ``hacrl track`` logs what is queued and waits for the flushers
(``make run`` and each Prefect flow run end with it).

What a record needs from the moment it was made (the git commit, the Prefect flow run, the
stage's own start and end times) is captured when it is queued; the DVC hashes of its inputs
and checkpoints are computed by the flusher, off the critical path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hacrl.config.schema import Config
from hacrl.ops.tracking import FLOW_RUN_ENV, Tracker, flow_run_url, foreign_store, git_commit, tracking_uri
from hacrl.pipeline.result import StageResult
from hacrl.storage import atomic_write_text

log = logging.getLogger(__name__)


def log_stage(cfg: Config, stage: str, t: int, result: Any, wall_s: float,
              error: BaseException | None = None, project_dir: str | os.PathLike = ".",
              started: float | None = None) -> None:
    """Log a stage execution; a tracking failure is a warning, never a failed stage.

    With ``tracking.asynchronous`` (the default) the record is queued and a background process
    logs it (:func:`flush`); otherwise it is logged before this returns.
    """
    if not cfg.tracking.enabled:
        return
    import time

    foreign = foreign_store(cfg, Path(project_dir))
    if foreign:
        log.warning("%s", foreign)
        return
    ended = time.time()
    started = ended - wall_s if started is None else started
    try:
        if cfg.tracking.asynchronous:
            enqueue(cfg, Path(project_dir), stage, t, result, wall_s, error, started, ended)
            start_flusher(cfg, Path(project_dir))
            return
        Tracker(cfg, project_dir).log_stage(stage, t, result, wall_s,
                                            f"{type(error).__name__}: {error}" if error is not None else None,
                                            start_ms=int(started * 1000), end_ms=int(ended * 1000))
    except Exception as e:  # lineage must not cost a finished stage its result
        log.warning("MLflow tracking failed for %s@it%d: %s: %s", stage, t, type(e).__name__, e)


def tracking_dir(cfg: Config, project_dir: Path) -> Path:
    return Path(project_dir) / cfg.experiment.runs_dir / ".tracking"


def enqueue(cfg: Config, project_dir: Path, stage: str, t: int, result: Any, wall_s: float,
            error: BaseException | None, started: float, ended: float) -> Path:
    """Write one stage record to the queue; return its path."""
    q = tracking_dir(cfg, project_dir) / "queue"
    q.mkdir(parents=True, exist_ok=True)
    record = {"stage": stage, "iteration": t, "result": result, "wall_s": wall_s,
              "tracked": result.tracked() if isinstance(result, StageResult) else None,
              "error": f"{type(error).__name__}: {error}" if error is not None else None,
              "start_ms": int(started * 1000), "end_ms": int(ended * 1000),
              "git_commit": git_commit(Path(project_dir)), "flow_run_id": os.environ.get(FLOW_RUN_ENV, ""),
              "flow_run_url": flow_run_url(os.environ.get(FLOW_RUN_ENV, "")),
              "tracking_uri": tracking_uri(cfg, Path(project_dir)),
              "config": dataclasses.asdict(cfg)}
    # the name orders records as they were queued (a later stage of the same iteration sorts after)
    path = q / f"{time.time_ns():020d}-{os.getpid()}-{stage}@it{t}.json"
    atomic_write_text(path, json.dumps(record, default=str))
    return path


def start_flusher(cfg: Config, project_dir: Path) -> None:
    """A detached process that logs the queue (its output goes to ``flush.log``, never to the
    stage's pipes: DVC and Prefect wait for those to close)."""
    d = tracking_dir(cfg, project_dir)
    with open(d / "flush.log", "ab") as out:
        subprocess.Popen([sys.executable, "-m", "hacrl.ops.track_queue", str(Path(project_dir).resolve()),
                          cfg.experiment.runs_dir], cwd=project_dir, stdin=subprocess.DEVNULL, stdout=out,
                         stderr=out, start_new_session=True, close_fds=True)


@contextlib.contextmanager
def _locked(d: Path, timeout_s: float | None) -> Iterator[bool]:
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "flush.lock", "a") as f:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline is not None else 0))
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pending(project_dir: Path, runs_dir: str) -> list[Path]:
    """Records queued and not yet logged, oldest first."""
    q = Path(project_dir) / runs_dir / ".tracking" / "queue"
    return sorted(q.glob("*.json")) if q.is_dir() else []


REASON = ".reason"
"""Beside a refused record in ``queue/failed/``: why MLflow refused it (one line)."""


def refused(project_dir: Path, runs_dir: str) -> list[tuple[Path, str]]:
    """Records MLflow refused, oldest first, each with the reason it gave."""
    f = Path(project_dir) / runs_dir / ".tracking" / "queue" / "failed"
    out = []
    for p in sorted(f.glob("*.json")) if f.is_dir() else []:
        r = p.with_name(p.name + REASON)
        out.append((p, r.read_text().strip() if r.exists() else "reason not recorded (see flush.log)"))
    return out


def requeue(project_dir: Path, runs_dir: str) -> int:
    """Put every refused record back in the queue (after the store was repaired); how many."""
    n = 0
    for p, _ in refused(project_dir, runs_dir):
        os.replace(p, p.parent.parent / p.name)
        p.with_name(p.name + REASON).unlink(missing_ok=True)
        n += 1
    return n


def flush(project_dir: Path, runs_dir: str, timeout_s: float | None = None) -> int:
    """Log every queued record (waiting for a running flusher first); return how many were logged.

    ``timeout_s``: give up waiting for the lock after that long (None: wait as long as it takes).
    """
    from hacrl.pipeline import params
    from hacrl.pipeline.result import StageResult

    project_dir = Path(project_dir)
    d = project_dir / runs_dir / ".tracking"
    logged = 0
    with _locked(d, timeout_s) as got:
        if not got:
            log.warning("another process holds %s; %d records stay queued", d / "flush.lock",
                        len(pending(project_dir, runs_dir)))
            return 0
        trackers: dict[tuple[str, str], Tracker] = {}
        for path in pending(project_dir, runs_dir):
            try:
                rec = json.loads(path.read_text())
                cfg = params.from_dict(rec["config"])
                foreign = foreign_store(cfg, project_dir)
                if foreign:  # records copied along with a workspace: never into the other's store
                    log.warning("%s; %d records stay queued", foreign, len(pending(project_dir, runs_dir)))
                    return logged
                key = (rec["git_commit"], rec["flow_run_id"], rec["tracking_uri"], cfg.experiment.name)
                if key not in trackers:  # one MLflow client per flusher (and commit, flow run, experiment)
                    trackers[key] = Tracker(cfg, project_dir, commit=rec["git_commit"],
                                            flow_run_id=rec["flow_run_id"], uri=rec["tracking_uri"],
                                            flow_run_url_=rec.get("flow_run_url"))
                tr = trackers[key]
                tr.cfg = cfg
                result = StageResult.from_record(rec["result"] if isinstance(rec["result"], dict) else {},
                                                 rec.get("tracked"))
                tr.log_stage(rec["stage"], rec["iteration"], result, rec["wall_s"], rec["error"],
                             start_ms=rec["start_ms"], end_ms=rec["end_ms"])
            except Exception as e:  # noqa: BLE001 - one bad record must not block the others
                failed = path.parent / "failed"
                failed.mkdir(exist_ok=True)
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
                (failed / (path.name + REASON)).write_text(reason + "\n")
                os.replace(path, failed / path.name)
                log.warning("MLflow refused %s (%s); moved to %s", path.name, reason, failed)
                continue
            path.unlink()
            logged += 1
    return logged


def main(argv: list[str] | None = None) -> int:
    """``python -m hacrl.ops.track_queue PROJECT RUNS_DIR``: the detached flusher."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    project, runs_dir = Path(argv[0]), argv[1]
    # behind the stages: on a small host the next stage starts while this one imports MLflow
    # (about 3 s of CPU), and a policy update beside it measured 15.8 s instead of 9.3 s.
    # Nothing here is timed; `hacrl track` (not niced) waits for what is left.
    with contextlib.suppress(OSError):
        os.nice(10)
    try:
        n = flush(project, runs_dir)
    except FileNotFoundError as e:  # the workspace went away meanwhile (a removed scratch dir)
        log.warning("nothing to log: %s", e)
        return 0
    if n:
        log.info("logged %d stage records to MLflow", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
