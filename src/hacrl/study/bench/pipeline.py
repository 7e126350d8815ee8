"""``pipeline``: one RL iteration directly, through ``dvc repro`` and through Prefect.

A scratch DVC workspace (a copy of the project's pipeline files, git + DVC initialised, tracking
to its own sqlite store) holds iteration 0 (the project's, when ``make run`` prepared it; else
prepared there by ``dvc repro``). Iteration 1 then runs, every round, as:

- ``direct``: the six stage functions of :mod:`hacrl.pipeline.stages` in this process (imports warm);
- ``dvc``: ``dvc repro --force --single-item STAGE@it1`` for the six stages (one process each,
  MLflow tracking on), then ``hacrl track`` until MLflow has every record (what ``make run``
  does after ``dvc repro``);
- ``prefect``: ``prefect deployment run hacrl/iterate --watch`` with ``iteration=1,force=true``
  against a Prefect server, pool and worker started once for the suite (``hacrl serve``; their
  start is not timed); the flow run ends once MLflow has the records;
- ``stage_process``: one stage process that does almost nothing
  (``hacrl stage compute-capability-stats``, a few milliseconds of work): the floor every
  stage of the DVC and Prefect paths pays.

Goals: ``dvc`` adds <= 15 s to ``direct``, ``prefect`` <= 25 s; ``stage_process`` <= 1.5 s.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hacrl.study.bench.core import Contender, Goal, SuiteResult, compare

log = logging.getLogger(__name__)
DEFAULT_REPS = 3
ITEMS = ("dvc.yaml", "conf", "src", "flows", "tasks", "prefect.yaml", ".gitignore", ".dvcignore", "pyproject.toml")


def _env(ws: Path) -> dict[str, str]:
    from hacrl.ops.services import client_env

    env = client_env(ws, {k: v for k, v in os.environ.items() if not k.startswith("HACRL_")})
    env["HACRL_LOG_LEVEL"] = "WARNING"
    return env


def _run(args: list[str], ws: Path) -> str:
    p = subprocess.run(args, cwd=ws, env=_env(ws), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout


_TIMELINE = """
import json, sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
with get_client(sync_client=True) as c:
    fr = c.read_flow_run(sys.argv[1])
    trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
    ts = sorted((t.start_time, t.end_time, t.name) for t in trs if t.start_time and t.end_time)
    print(json.dumps({"created": fr.created.timestamp(), "start": fr.start_time.timestamp(),
                      "end": fr.end_time.timestamp(),
                      "tasks": [(a.timestamp(), b.timestamp(), n) for a, b, n in ts]}))
"""


def _prefect_timeline(ws: Path, flow_run_id: str, cli_start: float, cli_end: float) -> dict:
    """Where a flow run's time went: the CLI until the flow run exists, waiting to be picked up
    and started (created -> running), before the first task (planning), in the tasks (each a
    ``dvc repro``), between them, after the last one (MLflow flush, completion), and the CLI
    after the flow run ended (``--watch`` waits 3 s for straggler logs: Prefect 3.9's
    ``FlowRunSubscriber``, not configurable from the CLI)."""
    import json

    try:
        d = json.loads(_run([sys.executable, "-c", _TIMELINE, flow_run_id], ws))
    except (RuntimeError, ValueError) as e:
        log.warning("no timeline for flow run %s: %s", flow_run_id, e)
        return {}
    tasks = d["tasks"]
    if not tasks:
        return {}
    in_tasks = sum(b - a for a, b, _ in tasks)
    return {"cli_until_created_s": round(d["created"] - cli_start, 2),
            "pickup_and_start_s": round(d["start"] - d["created"], 2),
            "planning_s": round(tasks[0][0] - d["start"], 2),
            "in_tasks_s": round(in_tasks, 2),
            "between_tasks_s": round(tasks[-1][1] - tasks[0][0] - in_tasks, 2),
            "after_tasks_s": round(d["end"] - tasks[-1][1], 2),
            "cli_after_end_s": round(cli_end - d["end"], 2),
            "flow_run_s": round(d["end"] - d["created"], 2)}


def scratch_workspace(size: str, ws: Path, project: Path) -> None:
    """A DVC workspace at ``ws`` with iteration 0 done (recorded in its dvc.lock)."""
    from hacrl.pipeline import table
    from hacrl.study.bench.workspace import SMOKE

    ws.mkdir(parents=True)
    for item in ITEMS:
        src = project / item
        if src.exists():
            (shutil.copytree if src.is_dir() else shutil.copy)(src, ws / item, **(
                {"ignore": shutil.ignore_patterns("__pycache__", "*.egg-info")} if src.is_dir() else {}))
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"],
                [sys.executable, "-m", "dvc", "config", "core.analytics", "false"]):
        _run(cmd, ws)
    prepared = size == "full" and (project / "data" / "tasks").is_dir() and \
        (project / "runs" / "it0" / "checkpoints").is_dir() and (project / "params.yaml").exists()
    if prepared:
        shutil.copy(project / "params.yaml", ws / "params.yaml")
        _run([sys.executable, "-m", "hacrl.cli", "config", "tracking.enabled=true"], ws)
        (ws / "data").mkdir()
        shutil.copytree(project / "data" / "tasks", ws / "data" / "tasks")
        shutil.copytree(project / "runs" / "it0", ws / "runs" / "it0")
        _run([sys.executable, "-m", "dvc", "repro", "-q", "--glob", "external-input@*"], ws)
        _run([sys.executable, "-m", "dvc", "commit", "-f", "-q", *table.prepare_stages()], ws)
    else:
        _run([sys.executable, "-m", "hacrl.cli", "config", *(SMOKE if size == "smoke" else []),
              "tracking.enabled=true"], ws)
        _run([sys.executable, "-m", "dvc", "repro", "-q", "evaluate-warmup"], ws)


def run(size: str, reps: int, work_dir: Path) -> SuiteResult:
    from hacrl.ops.services import serve, stop
    from hacrl.pipeline import params, table
    from hacrl.pipeline.table import iteration_stages, stage_id

    project = Path(".").resolve()
    ws = work_dir / "ws"
    scratch_workspace(size, ws, project)
    cfg = params.load(ws / "params.yaml")
    t = 1
    direct_cfg = params.load(ws / "params.yaml")
    direct_cfg.tracking.enabled = False
    per_stage: dict[str, list[float]] = {s: [] for s in iteration_stages()}

    def direct() -> int:
        here = Path.cwd()
        os.chdir(ws)
        try:
            for s in iteration_stages():
                t0 = time.perf_counter()
                table.run(s, direct_cfg, t)
                per_stage[s].append(round(time.perf_counter() - t0, 2))
        finally:
            os.chdir(here)
        return 1

    def dvc() -> dict:
        secs = {}
        for s in iteration_stages():
            t0 = time.perf_counter()
            _run([sys.executable, "-m", "dvc", "repro", "-q", "--force", "--single-item", stage_id(s, t)], ws)
            secs[s] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        _run([sys.executable, "-m", "hacrl.cli", "track"], ws)
        return {"units": 1, "per_stage_s": secs, "hacrl_track_s": round(time.perf_counter() - t0, 2)}

    def prefect() -> dict:
        t0 = time.time()
        out = _run(["prefect", "deployment", "run", "hacrl/iterate", "--watch", "--watch-interval", "1",
                    "--param", f"iteration={t}", "--param", "force=true"], ws)
        t1 = time.time()
        m = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
        return {"units": 1, **(_prefect_timeline(ws, m.group(1), t0, t1) if m else {})}

    def stage_process() -> int:
        _run([sys.executable, "-m", "hacrl.cli", "stage", "compute-capability-stats", "--iteration", str(t)], ws)
        return 1

    contenders = [Contender("direct", direct, "six stage functions in one process"),
                  Contender("dvc", dvc, "dvc repro --force --single-item x6, MLflow on, then hacrl track"),
                  Contender("prefect", prefect, "prefect deployment run hacrl/iterate --watch"),
                  Contender("stage_process", stage_process, "hacrl stage compute-capability-stats (MLflow on)")]
    t0 = time.time()
    serve(ws, 0, 0, gpu_workers=0, mlflow_ui=False)
    serve_s = time.time() - t0
    try:
        # the stage process first, so that its warm-up needs iteration 1's inputs: run dvc once
        dvc()
        measured = compare(contenders, reps)
    finally:
        stop(ws)
    work = {"agents": ", ".join(a.name for a in cfg.agents), "prompts": cfg.rollout.prompts_per_iteration,
            "samples_per_prompt": cfg.samples_per_prompt, "iteration": t,
            "direct_per_stage_median_s": {s: sorted(v)[len(v) // 2] for s, v in per_stage.items() if v},
            "services_start_s": round(serve_s, 1)}
    goals = [Goal("dvc", "direct", 15.0, "added_s"), Goal("prefect", "direct", 25.0, "added_s"),
             Goal("stage_process", "direct", 1.5, "max_s")]
    notes = ["units are iterations (1 per round): compare the seconds, not the rates"]
    return SuiteResult("pipeline", "iterations", work, measured, goals, notes, baseline="direct")
