"""The real Prefect path: `hacrl serve` (server on a free 127.0.0.1 port, work pools, the
deployments of prefect.yaml, workers, MLflow UI), then `prefect deployment run hacrl/iterate`.

One workspace, in order: an iteration through the deployment (six Completed stage tasks, the
policy update routed to the `gpu` pool), `dvc repro` afterwards runs nothing, a failing stage
marks the run Failed and the next run resumes at that stage, a held lock fails a second run
with a clear message, `hacrl stop` ends every process. The inventory splits the host into two
CPU shares, so the stage tasks carry MWRA's device tags and the learners update at once.

The `gpu` pool's worker here is a CPU process standing in for a GPU worker (no GPU on this
machine): it tests the routing, not GPU execution.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import SMOKE, dvc_workspace

from hacrl.orchestration import ITERATION_STAGES, workspace_lock
from hacrl.services import client_env

pytestmark = pytest.mark.slow

# the host split into two CPU shares (MWRA): the two learners' jobs hold one share each
CONFIG = SMOKE + ["experiment.iterations=1", "orchestration.retry_delay_s=1",
                  "resources.devices=[{id: 'cpu:0'}, {id: 'cpu:1'}]"]


def _env(repo: Path) -> dict:
    env = client_env(repo)
    env["HACRL_LOG_LEVEL"] = "WARNING"
    return env


def _run(args, repo, check=True, timeout=900):
    p = subprocess.run(args, cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def _api(repo: Path, path: str, body: dict | None = None):
    url = _env(repo)["PREFECT_API_URL"] + path
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _flow_runs(repo: Path, flow: str = "hacrl") -> list[dict]:
    runs = _api(repo, "/flow_runs/filter", {"flows": {"name": {"any_": [flow]}}, "sort": "START_TIME_ASC"})
    return [r for r in runs if r.get("start_time")]


def _task_runs(repo: Path, flow_run_id: str) -> dict[str, dict]:
    runs = _api(repo, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {r["name"]: r for r in runs}


def _logs(repo: Path, flow_run_id: str) -> str:
    logs = _api(repo, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})
    return "\n".join(entry["message"] for entry in logs)


def _iterate(repo: Path, *args: str, check: bool = True):
    return _run(["prefect", "deployment", "run", "hacrl/iterate", "--watch", "--watch-interval", "2", *args],
                repo, check=check)


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = dvc_workspace(tmp_path_factory.mktemp("prefect") / "repo",
                         ("dvc.yaml", "conf", "src", "flows", "tasks", "prefect.yaml", ".gitignore", ".dvcignore"))
    _run([sys.executable, "-m", "hacrl.cli", "config", *CONFIG], repo)
    # one stand-in worker on the gpu pool (see the module docstring)
    _run(["hacrl", "serve", "--project", str(repo), "--prefect-port", "0", "--mlflow-port", "0",
          "--gpu-workers", "1"], repo)
    try:
        yield repo
    finally:
        _run(["hacrl", "stop", "--project", str(repo)], repo, check=False)


def test_services_listen_on_localhost_only(served):
    env = _env(served)
    assert env["PREFECT_API_URL"].startswith("http://127.0.0.1:")
    assert env["HACRL_MLFLOW_UI"].startswith("http://127.0.0.1:")
    assert env["PREFECT_HOME"] == str(served / ".prefect")
    with urllib.request.urlopen(env["HACRL_MLFLOW_UI"] + "/health", timeout=10) as r:
        assert r.status == 200
    pools = {p["name"]: p for p in _api(served, "/work_pools/filter")}
    assert {"cpu", "gpu"} <= set(pools) and pools["gpu"]["concurrency_limit"] >= 1
    assert "Idle, and not used, while no worker with a GPU polls it" in pools["gpu"]["description"]


def test_iterate_runs_one_iteration_as_six_tasks_then_dvc_repro_runs_nothing(served):
    _iterate(served)
    runs = _flow_runs(served)
    assert len(runs) == 1 and runs[0]["state_type"] == "COMPLETED" and runs[0]["name"] == "iterate-it1"
    tasks = _task_runs(served, runs[0]["id"])
    for s in ITERATION_STAGES:
        assert tasks[f"{s}@it1"]["state_type"] == "COMPLETED", tasks.keys()
    assert {"prepare-data", "prepare-pool", "evaluate-warmup", "report"} <= set(tasks)
    # MWRA: the stage tasks hold the devices their jobs use, one slot per device tag
    shares = {"device:cpu:0", "device:cpu:1"}
    for s in ("generate-rollouts", "update-policies", "evaluate"):
        assert shares <= set(tasks[f"{s}@it1"]["tags"]), (s, tasks[f"{s}@it1"]["tags"])
    assert not any(x.startswith("device:") for x in tasks["verify-rewards@it1"]["tags"])
    limits = {c["tag"]: c["concurrency_limit"] for c in _api(served, "/concurrency_limits/filter")}
    assert limits == {"device:cpu:0": 1, "device:cpu:1": 1}
    # the policy update ran as a flow run of the gpu deployment, on the gpu pool
    gpu_runs = _flow_runs(served, "hacrl-stage")
    assert [(r["name"], r["work_pool_name"], r["state_type"]) for r in gpu_runs] == \
        [("update-policies@it1", "gpu", "COMPLETED")]

    repro = _run(["dvc", "repro"], served).stdout
    assert _ran(repro) == [], repro
    assert "up to date" in _run(["dvc", "status"], served).stdout

    # lineage of the Prefect-launched stages carries the flow run id
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{served / 'mlflow.db'}")
    mv = client.search_model_versions("name = 'smoke.gpt2-a' and tags.iteration = '1'")
    assert len(mv) == 1 and mv[0].tags["prefect_flow_run_id"] == runs[0]["id"]


def test_failed_stage_marks_the_run_failed_and_the_next_run_resumes_there(served):
    fault = json.dumps({"HACRL_FAULT": "raise:exchange-and-align@it2"})
    p = _iterate(served, "--job-variable", f"env={fault}", check=False)
    assert p.returncode != 0
    failed = _flow_runs(served)[-1]
    assert failed["state_type"] == "FAILED" and failed["name"] == "iterate-it2"
    tasks = _task_runs(served, failed["id"])
    assert tasks["generate-rollouts@it2"]["state_type"] == "COMPLETED"
    assert tasks["verify-rewards@it2"]["state_type"] == "COMPLETED"
    assert tasks["exchange-and-align@it2"]["state_type"] == "FAILED"
    assert tasks["exchange-and-align@it2"]["run_count"] == 2  # one retry (orchestration.retries=1)
    assert "update-policies@it2" not in tasks
    logs = _logs(served, failed["id"])
    assert "exchange-and-align@it2" in logs and "injected fault" in logs

    # the rerun resumes at the failed stage: DVC has the first two up to date; this run also
    # switches the update to the CPU pool through a Hydra override (a flow parameter)
    overrides = json.dumps(SMOKE + ["orchestration.retry_delay_s=1", "experiment.iterations=2",
                                     "orchestration.gpu_routing=local"])
    _iterate(served, "--param", f"overrides={overrides}")
    resumed = _flow_runs(served)[-1]
    assert resumed["state_type"] == "COMPLETED" and resumed["name"] == "iterate-it2"
    logs = _logs(served, resumed["id"])
    assert "generate-rollouts@it2: up to date" in logs and "verify-rewards@it2: up to date" in logs
    assert "exchange-and-align@it2: ran" in logs and "update-policies@it2: ran" in logs
    assert len(_flow_runs(served, "hacrl-stage")) == 1  # routing=local: no new gpu flow run

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{served / 'mlflow.db'}")
    exp = client.get_experiment_by_name("smoke").experiment_id
    stage_runs = client.search_runs([exp], "tags.`hacrl.iteration` = '2' and tags.`hacrl.kind` = 'stage'")
    by_stage: dict[str, list[str]] = {}
    for r in stage_runs:
        by_stage.setdefault(r.data.tags["hacrl.stage"], []).append(r.info.status)
    assert by_stage["generate-rollouts"] == ["FINISHED"]  # not redone
    assert sorted(by_stage["exchange-and-align"]) == ["FAILED", "FAILED", "FINISHED"]
    assert _ran(_run(["dvc", "repro"], served).stdout) == []


def test_a_second_run_cannot_take_the_workspace(served):
    n_before = len(_flow_runs(served))
    with workspace_lock(served, 0, holder="the test"):
        p = _iterate(served, "--param", "lock_timeout_s=1", check=False)
    assert p.returncode != 0
    run = _flow_runs(served)[-1]
    assert len(_flow_runs(served)) == n_before + 1 and run["state_type"] == "FAILED"
    logs = _logs(served, run["id"])
    assert "another iterate run holds the workspace lock" in logs and "the test" in logs
    assert "iterations: 2" in (served / "params.yaml").read_text()  # nothing was planned or run

    # naming an iteration that cannot run yet is a clear error, not a half-run
    assert _iterate(served, "--param", "iteration=5", check=False).returncode != 0
    logs = _logs(served, _flow_runs(served)[-1]["id"])
    assert "iteration: invalid value 5 (only 2 configured and done; the next one is 3)" in logs


def test_stop_ends_every_service(served):
    state = json.loads((served / ".services" / "services.json").read_text())
    _run(["hacrl", "stop", "--project", str(served)], served)
    for name, pgid in state["pgids"].items():
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    assert not (served / ".services.env").exists()
