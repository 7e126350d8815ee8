"""Prefect flow ``hacrl``, deployment ``iterate``: one RL iteration per flow run.

``prefect deployment run hacrl/iterate`` runs the next iteration not yet done (or the one named
by ``iteration``) as six tasks, one per stage, each through ``dvc repro --single-item`` so that
DVC records it; when every configured iteration is done, the experiment grows by one. A
workspace lock keeps two runs off the same iteration. ``update-policies`` (and any stage whose
jobs MWRA puts on GPUs) is a GPU task, routed to the ``gpu`` work pool when one has workers
(see ``orchestration.gpu_routing``); every stage task is tagged with the devices its jobs hold
(``device:cuda:0``, ``device:cpu:1``), each tag limited to one task at a time.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
if str(PROJECT) not in sys.path:  # the worker imports this file by path; `tasks` lives beside it
    sys.path.insert(0, str(PROJECT))

from prefect import flow, get_run_logger, runtime  # noqa: E402

from hacrl.ops.orchestration import (IterationFailed, StageFailed, device_tags, gpu_stages,  # noqa: E402
                                     iteration_markdown, plan_iteration, stage_devices, workspace_lock)
from hacrl.pipeline import params, table  # noqa: E402
from hacrl.pipeline.table import INPUT_STAGE, stage_id  # noqa: E402
from hacrl.resources import plan_for  # noqa: E402

from tasks.stages import dvc_stage, ensure_device_limits, gpu_stage  # noqa: E402


def _name_run(name: str) -> None:
    """Name the flow run after the iteration it runs (known only once planned)."""
    from prefect.client.orchestration import get_client

    if runtime.flow_run.id:
        with get_client(sync_client=True) as client:
            client.update_flow_run(runtime.flow_run.id, name=name)


def _track(project: Path, cfg, logger) -> None:
    """Log the stages' queued MLflow records before the run ends."""
    from hacrl.ops.tracking import foreign_store

    foreign = foreign_store(cfg, project) if cfg.tracking.enabled else None
    if foreign:
        logger.warning("%s", foreign)
    elif cfg.tracking.enabled:
        from hacrl.ops import track_queue

        n = track_queue.flush(project, cfg.experiment.runs_dir, timeout_s=cfg.orchestration.lock_timeout_s)
        # a run that queued none has nothing to say here
        logger.log(logging.INFO if n else logging.DEBUG, "MLflow: %d stage record%s logged by this flow run", n,
                   "" if n == 1 else "s")


def _publish(project: Path, cfg, t: int, done: dict[str, str], logger) -> None:
    """The iteration's accuracy table with links to MLflow, as the flow run's markdown artifact."""
    from prefect.artifacts import create_markdown_artifact

    md = iteration_markdown(project, cfg, t, done, os.environ.get("HACRL_MLFLOW_UI"))
    create_markdown_artifact(md, key=f"{_artifact_key(cfg.experiment.name)}-it{t}",
                             description=f"{cfg.experiment.name}: held-out accuracy after iteration {t}")
    from hacrl.storage import RunLayout, read_json

    path = RunLayout(project / cfg.experiment.runs_dir).eval_metrics(t)
    acc = read_json(path)["agents"] if path.exists() else {}
    logger.info("held-out accuracy after iteration %d: %s", t,
                ", ".join(f"{a} {100 * m['eval_accuracy']:.1f} %" for a, m in acc.items() if "eval_accuracy" in m))


def _artifact_key(name: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    import re

    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "experiment"


@flow(name="hacrl", log_prints=True)
def iterate(iteration: int | None = None, overrides: list[str] | None = None, force: bool = False,
            project_dir: str | None = None, lock_timeout_s: float | None = None) -> dict:
    """Run one RL iteration of the experiment in ``project_dir`` (default: this checkout).

    Args:
        iteration: the iteration to run; default the first one not done (or the next new one).
        overrides: Hydra overrides; params.yaml is recomposed from conf/ with them first.
        force: re-run the iteration's stages even if DVC has them up to date.
        project_dir: the DVC workspace (default ``$HACRL_PROJECT_DIR`` or this checkout).
        lock_timeout_s: how long to wait for another run's workspace lock (default: config).
    """
    logger = get_run_logger()
    project = Path(project_dir or os.environ.get("HACRL_PROJECT_DIR") or PROJECT).resolve()
    cfg = params.load(project / "params.yaml")
    timeout = cfg.orchestration.lock_timeout_s if lock_timeout_s is None else lock_timeout_s
    with workspace_lock(project, timeout, holder=f"flow run {runtime.flow_run.name} ({runtime.flow_run.id})"):
        plan = plan_iteration(project, iteration, overrides)
        cfg = params.load(project / "params.yaml")
        o = cfg.orchestration
        for stage, outs in sorted(plan.changed.items()):  # said, not silently repaired
            logger.warning("%s: %s on disk, not what DVC recorded; the stage that wrote it is run again or "
                           "restored from DVC's run cache when this run reaches it", stage,
                           ", ".join(f"{p} {why}" for p, why in sorted(outs.items())))
        retry = {"retries": o.retries, "retry_delay_seconds": o.retry_delay_s}
        # MWRA: each stage task is tagged with the devices its jobs hold (one slot per device),
        # and a stage with jobs on GPUs goes to the GPU pool
        rplan = plan_for(cfg)
        prepare, iteration_stages = table.prepare_stages(), table.iteration_stages()
        tags = {s: device_tags(stage_devices(cfg, s, rplan)) for s in (*prepare, *iteration_stages)}
        ensure_device_limits(sorted({x for v in tags.values() for x in v}))
        on_gpu = gpu_stages(cfg)
        done: dict[str, str] = {}

        def run(todo: list[tuple[str, str]], t: int | None) -> None:
            for i, (s, sid) in enumerate(todo, 1):
                logger.debug("stage %d/%d: %s", i, len(todo), sid)  # the task run's own events say it
                opts = dict(name=s, task_run_name=sid, **retry)
                try:
                    if s in on_gpu:
                        done[sid] = gpu_stage.with_options(tags={*gpu_stage.tags, *tags[s]}, **opts)(
                            str(project), sid, force and s in iteration_stages, o.gpu_routing, o.gpu_pool,
                            o.gpu_deployment)
                    else:
                        done[sid] = dvc_stage.with_options(tags={*dvc_stage.tags, *tags.get(s, ())}, **opts)(
                            str(project), sid, force and s in iteration_stages)
                except StageFailed as e:  # one line: the stage and why (the task's log has the rest)
                    _track(project, cfg, logger)
                    # Prefect logs it as the flow run's end, one line (orchestration.ExpectedFailures)
                    raise IterationFailed(t, sid, e.reason) from None

        if plan.prepare:  # which iterations that leaves to do is known once it ran: plan again then
            logger.info("preparing first: %s", ", ".join([*plan.inputs, *prepare]))
            run([(INPUT_STAGE, s) for s in plan.inputs] + [(s, s) for s in prepare], None)
            plan = plan_iteration(project, iteration)
            if plan.iteration is None:
                raise IterationFailed(None, ", ".join(sorted(plan.stale)), "still stale after preparing")
        t = plan.iteration
        _name_run(f"iterate-it{t}")
        logger.info("iteration %d of %d%s", t, plan.configured, " (experiment extended by one)" if plan.extended
                    else "")
        report = [(s.name, s.name) for s in table.STAGES if s.kind == table.REPORT]
        run([(s, stage_id(s, t)) for s in iteration_stages] + (report if t == plan.configured else []), t)
        _track(project, cfg, logger)
        _publish(project, cfg, t, done, logger)
    logger.info("iteration %d done: %s", t, ", ".join(f"{s} {what}" for s, what in done.items()))
    return {"iteration": t, "configured": plan.configured, "extended": plan.extended, "stages": done}


if __name__ == "__main__":
    iterate()
