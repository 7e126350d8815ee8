"""Prefect tasks: one DVC stage each, and the GPU-routed policy update.

Each task runs ``dvc repro --single-item STAGE`` (see ``hacrl.ops.orchestration``), so DVC records
what Prefect ran and skips what is already up to date; the stage's output streams to the task's
log. Config and data errors (exit 2), non-finite losses (exit 3) and a full disk (exit 4) are not retried.

The tasks carry no tags of their own, only the device tags MWRA gives them (which carry a
concurrency limit of one each): Prefect 3.9 asks for concurrency slots for every tag a task
has, and with a label tag (``hacrl``) that asked-for slot held some task starts up ~2 s
(measured: one stage in most iterations of a flow run, none without it). The task names
(``dvc-stage``, ``gpu-stage``) say what a label tag would.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import get_run_logger, runtime, task

from hacrl.ops.orchestration import (STAGE_LOG_DIR, ExpectedFailures, StageFailed, TaskCompletedEcho, failure_tail,
                                     run_dvc_stage, stage_seconds, task_summary)
from hacrl.ops.tracking import FLOW_RUN_ENV

# what Prefect logs of a run: a failed stage in one line and its output's end, no engine traceback
for _name, _filters in (("prefect.task_runs", (ExpectedFailures, TaskCompletedEcho)),
                        ("prefect.flow_runs", (ExpectedFailures,))):
    for _f in _filters:
        if not any(isinstance(x, _f) for x in logging.getLogger(_name).filters):
            logging.getLogger(_name).addFilter(_f())


def _retryable(task, task_run, state) -> bool:
    """Retry a failed stage unless its exit code says retrying cannot help."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:
        return True
    return not (isinstance(exc, StageFailed) and not exc.retryable)


@task(name="dvc-stage", retry_condition_fn=_retryable)
def dvc_stage(project_dir: str, stage: str, force: bool = False) -> str:
    """Run one DVC stage (``name@itT``); return ``ran``, ``restored`` or ``up-to-date``."""
    logger = get_run_logger()
    flow_run_id = runtime.flow_run.root_flow_run_id or runtime.flow_run.id or ""
    secs: float | None = None

    def on_line(line: str) -> None:  # the stage's figures and warnings; the rest stays in its log file
        nonlocal secs
        took = stage_seconds([line])  # its "finished in" line (0.0 s is a time too)
        secs = secs if took is None else took
        shown = task_summary(line)
        if shown is not None:
            logger.log(shown[0], "%s", shown[1])
        else:
            logger.debug("%s", line)

    log_file = f"{STAGE_LOG_DIR}/{stage}.log"
    try:
        status = run_dvc_stage(Path(project_dir), stage, force, env={FLOW_RUN_ENV: str(flow_run_id)},
                               on_line=on_line, log_file=Path(project_dir) / log_file)
    except StageFailed as e:  # each attempt's end, retried or not (Prefect then logs the one line)
        logger.error("%s", failure_tail(e))
        raise
    logger.info("%s: %s", stage, {"ran": f"ran{f' in {secs:.1f}s' if secs is not None else ''} ({log_file})",
                                  "restored": "restored from DVC's run cache",
                                  "up-to-date": "up to date (DVC), skipped"}[status])
    return status


def ensure_device_limits(tags: list[str]) -> None:
    """A tag concurrency limit of 1 for each device tag (``hacrl.ops.orchestration.device_tags``):
    a task holding ``device:cuda:0`` waits while another flow run's task holds it."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    if not tags:
        return
    with get_client(sync_client=True) as client:
        for tag in tags:
            try:
                if client.read_concurrency_limit_by_tag(tag).concurrency_limit == 1:
                    continue
            except ObjectNotFound:
                pass
            client.create_concurrency_limit(tag=tag, concurrency_limit=1)


def gpu_pool_has_workers(pool: str) -> bool:
    """Whether work pool ``pool`` exists and has at least one online worker."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.read_work_pool(pool)
            workers = client.read_workers_for_work_pool(pool)
    except Exception:  # no such pool, or no API: stay local
        return False
    return any(str(getattr(w, "status", "")).upper().endswith("ONLINE") for w in workers)


@task(name="gpu-stage", retry_condition_fn=_retryable)
def gpu_stage(project_dir: str, stage: str, force: bool, routing: str, pool: str, deployment: str) -> str:
    """A GPU stage: on ``pool`` through ``deployment`` when routed there, else in this flow."""
    logger = get_run_logger()
    if routing == "pool" or (routing == "auto" and gpu_pool_has_workers(pool)):
        from prefect.deployments import run_deployment

        logger.info("%s: routed to work pool %r (deployment %s)", stage, pool, deployment)
        fr = run_deployment(deployment, parameters={"project_dir": project_dir, "stage": stage, "force": force},
                            timeout=None, as_subflow=True)
        if not fr.state or not fr.state.is_completed():
            raise StageFailed(stage, None, f"flow run {fr.name} on work pool {pool!r} ended "
                                           f"{fr.state.type.value if fr.state else 'without a state'}: "
                                           f"{fr.state.message if fr.state else ''}")
        return f"ran on {pool}"
    logger.info("%s: no GPU pool in use (routing=%s); running in this flow", stage, routing)
    return dvc_stage.fn(project_dir, stage, force)
