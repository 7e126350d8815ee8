"""``hacrl iterate``: start one iterate flow run, named after its iteration, and follow it.

``prefect deployment run hacrl/iterate --watch`` works too, but its run gets a random name
until the flow has planned (``iterate-itT`` only then), and a failure ends with "Flow run
finished in state 'Failed'". This creates the run already named ``iterate-itT`` (the iteration
is read from ``dvc status`` as the flow will choose it, without writing anything), prints each
stage as it starts and ends, and a failure as one line: the stage and its reason.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from hacrl.ops.orchestration import next_iteration

DEPLOYMENT = "hacrl/iterate"
_MARK = {"RUNNING": "▶", "COMPLETED": "✓", "FAILED": "✗", "CRASHED": "✗", "CANCELLED": "✗"}


class NoPrefect(RuntimeError):
    """No Prefect server (or no ``hacrl/iterate`` deployment) to run on."""


def flow_failure(message: str) -> str:
    """The one-line reason in a failed flow run's state message (Prefect prefixes the
    exception's type and text with its own words)."""
    m = re.search(r"IterationFailed: (.*)", message or "")
    if m:
        return m.group(1).strip()
    m = re.search(r"exception: (.*)", message or "")
    return (m.group(1) if m else message or "no message").strip().splitlines()[0]


RUNNING_EVERY_S = 30.0
"""A stage still running says so, with its elapsed time, this often (a long update shows life)."""


def result_lines(project: Path, t: int) -> list[str]:
    """What an iteration gave, for the terminal: held-out accuracy per agent with the change since
    the previous iteration, and where to look (MLflow's runs, in the machine-learning view)."""
    from hacrl.pipeline import params
    from hacrl.storage import RunLayout, read_json

    try:
        cfg = params.load(project / "params.yaml")
    except Exception:  # noqa: BLE001 - the figures are a courtesy after a completed run
        return []
    lay = RunLayout(project / cfg.experiment.runs_dir)
    now, before = lay.eval_metrics(t), lay.eval_metrics(t - 1) if t > 0 else None
    if not now.exists():
        return []
    cur = read_json(now)["agents"]
    prev = read_json(before)["agents"] if before is not None and before.exists() else {}
    parts = []
    for a, m in cur.items():
        if "eval_accuracy" not in m:
            continue
        delta = (f" ({100 * (m['eval_accuracy'] - prev[a]['eval_accuracy']):+.1f})"
                 if "eval_accuracy" in prev.get(a, {}) else "")
        parts.append(f"{a} {100 * m['eval_accuracy']:.1f} %{delta}")
    lines = [f"held-out accuracy after iteration {t}: " + ", ".join(parts)] if parts else []
    ui = os.environ.get("HACRL_MLFLOW_UI")
    if ui and cfg.tracking.enabled:
        from hacrl.ops.tracking import runs_url

        try:
            lines.append(f"MLflow: {runs_url(ui, cfg, project)}")
        except Exception:  # noqa: BLE001 - a store that cannot be read: the figures still stand
            pass
    return lines


def override_effect(project: Path, new: dict) -> list[str]:
    """What recomposing params.yaml as ``new`` changes, said before a flow run starts: the settings
    that change (generated keys such as ``iterations`` aside), the stages whose params they are
    (dvc.yaml), and the first iteration that runs again. Empty when nothing changes."""
    from hacrl.config.build import read_yaml
    from hacrl.ops.tracking import flatten  # as MLflow's params show them, credentials redacted
    from hacrl.pipeline.params import GENERATED_KEYS

    pfile, dfile = project / "params.yaml", project / "dvc.yaml"
    if not pfile.exists() or not dfile.exists():
        return []

    def settings(d: dict) -> dict[str, str]:
        return flatten({k: v for k, v in d.items() if k not in GENERATED_KEYS})

    old_flat, new_flat = settings(read_yaml(pfile) or {}), settings(new)
    changed = sorted(k for k in old_flat.keys() | new_flat.keys() if old_flat.get(k) != new_flat.get(k))
    if not changed:
        return []
    shown = ", ".join(f"{k} {old_flat.get(k, '(none)')} -> {new_flat.get(k, '(none)')}" for k in changed[:6])
    lines = [f"overrides change {len(changed)} setting(s): {shown}" + (" ..." if len(changed) > 6 else "")]
    stale, first = [], None
    for name, st in ((read_yaml(dfile) or {}).get("stages") or {}).items():
        body = st.get("do", st)
        keys = [k for k in body.get("params", []) if isinstance(k, str)]
        if any(c == k or c.startswith(k + ".") for c in changed for k in keys):
            stale.append(name)
            if "foreach" in st:
                first = 1 if first is None else min(first, 1)
            elif name in ("prepare-data", "prepare-pool"):
                first = 0
    if stale:
        lines.append(f"stale: {', '.join(stale)} (every iteration of a per-iteration stage); "
                     + ("the pool is prepared again, then iteration 1 runs" if first == 0 else
                        "this run redoes iteration 1; later iterations follow in later runs"
                        if first == 1 else "only the report is redone"))
        lines.append("a config that changes results starts a new MLflow experiment run (tag hacrl.supersedes); "
                     "the old runs stay")
    return lines


SKIPPED = {"up to date (DVC), skipped": ", up to date", "restored from DVC's run cache": ", restored"}
"""What a stage task logs when it did not run its stage (tasks/stages.py), as the terminal says it."""


def _what_it_did(client, task_run_id, stage: str, wait_s: float = 5.0) -> str:
    """``, up to date`` / ``, restored`` for a stage task that did not run its stage, else ``""``,
    read from the task's own last log line (``STAGE: ...``). Prefect ships logs in batches, so a
    task may be COMPLETED before its last line reached the server: wait for it (``wait_s`` at
    most; a log that cannot be read says nothing)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    deadline = time.monotonic() + wait_s
    while True:
        try:
            logs = client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])), limit=200)
        except Exception:  # noqa: BLE001 - a courtesy line, never a failure
            return ""
        final = [m for log in logs for m in [log.message or ""] if m.startswith(f"{stage}: ")
                 and (m.startswith(f"{stage}: ran") or "routed to work pool" in m or any(k in m for k in SKIPPED))]
        if final:
            return next((v for k, v in SKIPPED.items() if k in final[-1]), "")
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.2)


def launch(project: Path, iteration: int | None = None, force: bool = False, overrides: list[str] | None = None,
           watch: bool = True, poll_s: float = 1.0, out: Callable[[str], None] = print) -> int:
    """Create an iterate flow run named ``iterate-itT``; with ``watch``, follow it to the end.

    Returns 0 when it completed (or was only created), 1 when it failed. Raises
    :class:`hacrl.errors.ConfigError` for an iteration that cannot run, :class:`NoPrefect`
    without a server.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.exceptions import ObjectNotFound

    if not os.environ.get("PREFECT_API_URL"):  # Prefect would start a throwaway server of its own
        raise NoPrefect("no Prefect server: run `make serve` first (hacrl iterate finds its services; "
                        "elsewhere `source .services.env`)")
    if overrides:  # refused here, before a flow run exists (the flow recomposes params.yaml with them)
        from hacrl.pipeline.params import compose

        for line in override_effect(project, compose(list(overrides))):  # said before anything runs
            out(line)
    # with overrides the iteration is chosen once params.yaml is recomposed: the flow names its run then
    t = None if overrides else next_iteration(project, iteration)  # None: known once prepared
    name = f"iterate-it{t}" if t is not None else "iterate"
    params: dict = {"project_dir": str(project)}
    if iteration is not None:
        params["iteration"] = iteration
    if force:
        params["force"] = True
    if overrides:
        params["overrides"] = list(overrides)
    try:
        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name(DEPLOYMENT)
            fr = client.create_flow_run_from_deployment(dep.id, parameters=params, name=name)
    except ObjectNotFound:
        raise NoPrefect(f"no deployment {DEPLOYMENT} on {os.environ.get('PREFECT_API_URL', 'this Prefect')}: "
                        f"run `make serve` first") from None
    except Exception as e:  # connection refused, no API URL
        raise NoPrefect(f"no Prefect server at {os.environ.get('PREFECT_API_URL', '(PREFECT_API_URL unset)')}: "
                        f"run `make serve` (and `source .services.env`) first ({type(e).__name__})") from None
    ui = os.environ.get("PREFECT_UI_URL") or os.environ.get("PREFECT_API_URL", "").removesuffix("/api")
    out(f"flow run {name} created: {ui}/runs/flow-run/{fr.id}" if ui else f"flow run {name}: {fr.id}")
    if not watch:
        return 0
    said: dict[str, set] = {}  # per task: what was printed (a start, each retry, the end)
    t0 = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(fr.id)
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            for tr in sorted(tasks, key=lambda x: x.created):
                state = tr.state_type.value if tr.state_type else "PENDING"
                if state not in _MARK:
                    continue  # scheduled, pending, awaiting a retry: nothing to say yet
                done = said.setdefault(tr.name, set())
                if "start" not in done:  # also for a task that started and ended between two polls
                    out(f"  ▶ {tr.name}")
                    done.add("start")
                if tr.run_count > 1 and ("retry", tr.run_count) not in done:
                    out(f"  ↻ {tr.name} (attempt {tr.run_count})")
                    done.add(("retry", tr.run_count))
                if state == "RUNNING" and tr.start_time is not None:  # a long stage shows life
                    ran = time.time() - tr.start_time.timestamp()
                    tick = int(ran // RUNNING_EVERY_S)
                    if tick >= 1 and ("tick", tr.run_count, tick) not in done:
                        out(f"  · {tr.name} running, {tick * RUNNING_EVERY_S:.0f} s")
                        done.add(("tick", tr.run_count, tick))
                if state != "RUNNING" and ("end", state, tr.run_count) not in done:
                    what = _what_it_did(client, tr.id, tr.name) if state == "COMPLETED" else ""
                    took = f" ({tr.total_run_time.total_seconds():.1f} s{what})" if state == "COMPLETED" else ""
                    out(f"  {_MARK[state]} {tr.name}{took}")
                    done.add(("end", state, tr.run_count))
            if run.state is not None and run.state.is_final():
                break
            time.sleep(poll_s)
    took = time.monotonic() - t0
    name = run.name
    if run.state.is_completed():
        out(f"{name}: completed in {took:.0f} s")
        m = re.fullmatch(r"iterate-it(\d+)", name or "")
        for line in result_lines(project, int(m.group(1))) if m else []:
            out(line)
        if ui:
            out(f"Prefect: {ui}/runs/flow-run/{fr.id}")
        return 0
    out(f"{name}: {run.state.type.value.lower()}: {flow_failure(run.state.message or '')}")
    return 1
