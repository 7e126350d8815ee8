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

import os
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
if str(PROJECT) not in sys.path:  # the worker imports this file by path; `tasks` lives beside it
    sys.path.insert(0, str(PROJECT))

from prefect import flow, get_run_logger, runtime  # noqa: E402

from hacrl import config as config_mod  # noqa: E402
from hacrl.orchestration import (ITERATION_STAGES, PREPARE_STAGES, device_tags,  # noqa: E402
                                 gpu_stages, plan_iteration, stage_devices, stage_id, workspace_lock)
from hacrl.resources import plan_for  # noqa: E402
from tasks.stages import dvc_stage, ensure_device_limits, gpu_stage  # noqa: E402


def _name_run(name: str) -> None:
    """Name the flow run after the iteration it runs (known only once planned)."""
    from prefect.client.orchestration import get_client

    if runtime.flow_run.id:
        with get_client(sync_client=True) as client:
            client.update_flow_run(runtime.flow_run.id, name=name)


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
    cfg = config_mod.load(project / "params.yaml")
    timeout = cfg.orchestration.lock_timeout_s if lock_timeout_s is None else lock_timeout_s
    with workspace_lock(project, timeout, holder=f"flow run {runtime.flow_run.name} ({runtime.flow_run.id})"):
        plan = plan_iteration(project, iteration, overrides)
        t = plan.iteration
        _name_run(f"iterate-it{t}")
        cfg = config_mod.load(project / "params.yaml")
        o = cfg.orchestration
        logger.info("iteration %d of %d%s%s", t, plan.configured, " (experiment extended by one)" if plan.extended
                    else "", "; preparing data and pool first" if plan.prepare else "")
        retry = {"retries": o.retries, "retry_delay_seconds": o.retry_delay_s}
        # MWRA: each stage task is tagged with the devices its jobs hold (one slot per device),
        # and a stage with jobs on GPUs goes to the GPU pool
        rplan = plan_for(cfg)
        tags = {s: device_tags(stage_devices(cfg, s, rplan)) for s in (*PREPARE_STAGES, *ITERATION_STAGES)}
        ensure_device_limits(sorted({x for v in tags.values() for x in v}))
        on_gpu = gpu_stages(cfg)
        done: dict[str, str] = {}
        if plan.prepare:
            for s in PREPARE_STAGES:
                if s in on_gpu:
                    done[s] = gpu_stage.with_options(name=s, task_run_name=s, tags={*gpu_stage.tags, *tags[s]},
                                                     **retry)(str(project), s, False, o.gpu_routing, o.gpu_pool,
                                                              o.gpu_deployment)
                else:
                    done[s] = dvc_stage.with_options(name=s, task_run_name=s, tags={*dvc_stage.tags, *tags[s]},
                                                     **retry)(str(project), s)
        for s in ITERATION_STAGES:
            sid = stage_id(s, t)
            if s in on_gpu:
                done[sid] = gpu_stage.with_options(name=s, task_run_name=sid, tags={*gpu_stage.tags, *tags[s]},
                                                   **retry)(
                    str(project), sid, force, o.gpu_routing, o.gpu_pool, o.gpu_deployment)
            else:
                done[sid] = dvc_stage.with_options(name=s, task_run_name=sid, tags={*dvc_stage.tags, *tags[s]},
                                                   **retry)(str(project), sid, force)
        if t == plan.configured:
            done["report"] = dvc_stage.with_options(name="report", task_run_name="report", **retry)(
                str(project), "report")
        if cfg.tracking.enabled:  # the stages' queued MLflow records, logged before the run ends
            from hacrl import track_queue

            n = track_queue.flush(project, cfg.experiment.runs_dir, timeout_s=o.lock_timeout_s)
            logger.info("MLflow: %d stage records logged by this flow run", n)
    logger.info("iteration %d done: %s", t, done)
    return {"iteration": t, "configured": plan.configured, "extended": plan.extended, "stages": done}


if __name__ == "__main__":
    iterate()
