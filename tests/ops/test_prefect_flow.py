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

from hacrl.ops.launch import flow_failure
from hacrl.ops.orchestration import workspace_lock
from hacrl.ops.services import client_env
from hacrl.pipeline.table import iteration_stages

from conftest import SMOKE, dvc_workspace

pytestmark = pytest.mark.slow

# the host split into two CPU shares (MWRA): the two learners' jobs hold one share each
CONFIG = SMOKE + ["experiment.iterations=1", "orchestration.retry_delay_s=1",
                  "resources.devices=[{id: 'cpu:0'}, {id: 'cpu:1'}]"]


def _env(repo: Path) -> dict:
    env = client_env(repo)
    env["HACRL_LOG_LEVEL"] = "WARNING"
    env["COLUMNS"] = "500"  # Prefect's CLI prints through rich, which wraps at the terminal width
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


# README: prefect deployment run hacrl/iterate --watch
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
    # one stand-in worker on the gpu pool (see the module docstring); `make serve` is `make setup`
    # then this, `make stop` is `hacrl stop` (below)
    # README: make serve
    # README: make stop
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
    # the shell set-up the README prints
    # README: source .venv/bin/activate && source .services.env
    (served / ".venv").symlink_to(Path(sys.executable).parents[1])
    sh = subprocess.run(["bash", "-c", "source .venv/bin/activate && source .services.env && "
                                       "echo \"$PREFECT_API_URL|$HACRL_MLFLOW_UI|$(command -v hacrl)\""],
                        cwd=served, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(served)})
    assert sh.returncode == 0 and sh.stdout.strip() == \
        f"{env['PREFECT_API_URL']}|{env['HACRL_MLFLOW_UI']}|{Path(sys.executable).parent / 'hacrl'}", sh
    pools = {p["name"]: p for p in _api(served, "/work_pools/filter")}
    assert {"cpu", "gpu"} <= set(pools) and pools["gpu"]["concurrency_limit"] >= 1
    assert "Idle, and not used, while no worker with a GPU polls it" in pools["gpu"]["description"]


def test_iterate_runs_one_iteration_as_six_tasks_then_dvc_repro_runs_nothing(served):
    # README: hacrl iterate
    out = _run(["hacrl", "iterate"], served).stdout.splitlines()
    # named iterate-it1 when created, before the flow planned anything; each stage as it runs
    assert out[0].startswith("flow run iterate-it1 created: http://127.0.0.1:"), out
    assert "  ▶ prepare-data" in out and "  ▶ generate-rollouts@it1" in out
    assert out.index("  ▶ generate-rollouts@it1") < out.index("  ▶ update-policies@it1")
    assert any(ln.startswith("  ✓ evaluate@it1 (") for ln in out)
    # it ends with the result: the completion, held-out accuracy per agent, where to look
    done = next(i for i, ln in enumerate(out) if ln.startswith("iterate-it1: completed in "))
    assert out[done + 1].startswith("held-out accuracy after iteration 1: ") and "%" in out[done + 1], out
    assert out[-1].startswith("Prefect: http://127.0.0.1:") and "/runs/flow-run/" in out[-1], out
    runs = _flow_runs(served)
    assert len(runs) == 1 and runs[0]["state_type"] == "COMPLETED" and runs[0]["name"] == "iterate-it1"
    # the flow run's report: per-agent accuracy, linked to the MLflow runs and models
    (art,) = _api(served, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [runs[0]["id"]]}}})
    mlflow_ui = _env(served)["HACRL_MLFLOW_UI"]
    acc = json.loads((served / "runs" / "it1" / "eval_metrics.json").read_text())["agents"]["gpt2-a"]
    assert art["type"] == "markdown" and art["key"] == "smoke-it1"
    assert f"| gpt2-a | {100 * acc['eval_accuracy']:.1f} % |" in art["data"]
    assert f"]({mlflow_ui}/#/experiments/" in art["data"] and "/models/m-" in art["data"]
    assert "generate-rollouts@it1 ran" in art["data"]
    tasks = _task_runs(served, runs[0]["id"])
    for s in iteration_stages():
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
    assert mv[0].tags["prefect_flow_run_url"] == f"{_env(served)['PREFECT_API_URL'][:-4]}/runs/flow-run/{runs[0]['id']}"


def test_failed_stage_marks_the_run_failed_with_a_one_line_reason_and_the_next_run_resumes_there(served):
    fault = json.dumps({"HACRL_FAULT": "raise:exchange-and-align@it2"})
    p = _iterate(served, "--job-variable", f"env={fault}", check=False)
    assert p.returncode != 0
    # the watched run: the failure in one line, then the end of the stage's output, and no
    # traceback through Prefect's engine (orchestration.ExpectedFailures)
    assert "prefect/task_engine.py" not in p.stdout and "prefect/flow_engine.py" not in p.stdout, p.stdout
    assert "the end of exchange-and-align@it2's output (all of it: logs/exchange-and-align@it2.log)" in p.stdout
    assert len(p.stdout.splitlines()) < 90, p.stdout
    assert "injected fault" in (served / "logs" / "exchange-and-align@it2.log").read_text()
    failed = _flow_runs(served)[-1]
    assert failed["state_type"] == "FAILED" and failed["name"] == "iterate-it2"
    tasks = _task_runs(served, failed["id"])
    assert tasks["generate-rollouts@it2"]["state_type"] == "COMPLETED"
    assert tasks["verify-rewards@it2"]["state_type"] == "COMPLETED"
    assert tasks["exchange-and-align@it2"]["state_type"] == "FAILED"
    assert "\n" not in tasks["exchange-and-align@it2"]["state"]["message"]
    assert tasks["exchange-and-align@it2"]["run_count"] == 2  # one retry (orchestration.retries=1)
    assert "update-policies@it2" not in tasks
    logs = _logs(served, failed["id"])
    assert "exchange-and-align@it2" in logs and "injected fault" in logs
    # the reason in one line: in the watched output, and as the run's state message
    one_line = "iteration 2 failed at exchange-and-align@it2: InjectedFault: injected fault in exchange-and-align@it2"
    assert one_line in " ".join(p.stdout.split()), p.stdout
    assert one_line in failed["state"]["message"] and flow_failure(failed["state"]["message"]).startswith(one_line)

    # the rerun resumes at the failed stage: DVC has the first two up to date; this run also
    # switches the update to the CPU pool through a Hydra override (a flow parameter)
    # README's override form (other values: a new lr would make iteration 1 stale)
    # README: hacrl iterate trainer.lr=1e-4
    out = _run(["hacrl", "iterate", *SMOKE, "orchestration.retry_delay_s=1", "experiment.iterations=2",
                "orchestration.gpu_routing=local"], served).stdout
    assert any(ln.startswith("iterate-it2: completed in ") for ln in out.splitlines()), out
    assert "held-out accuracy after iteration 2: " in out and out.splitlines()[-1].startswith("Prefect: "), out
    # the stages DVC had up to date say so (the failed run finished the first two)
    assert any(ln.startswith("  ✓ generate-rollouts@it2 (") and ln.endswith(", up to date)") for ln in out.splitlines()), out
    resumed = _flow_runs(served)[-1]
    assert resumed["state_type"] == "COMPLETED" and resumed["name"] == "iterate-it2"
    logs = _logs(served, resumed["id"])
    assert "generate-rollouts@it2: up to date" in logs and "verify-rewards@it2: up to date" in logs
    assert "exchange-and-align@it2: ran" in logs and "update-policies@it2: ran" in logs
    assert len(_flow_runs(served, "hacrl-stage")) == 1  # routing=local: no new gpu flow run

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{served / 'mlflow.db'}")
    exp = client.get_experiment_by_name("smoke").experiment_id
    # one MLflow run for iteration 2: failed twice in exchange-and-align, resumed, finished
    (it2,) = client.search_runs([exp], "tags.`hacrl.iteration` = '2' and tags.`hacrl.kind` = 'iteration'")
    assert it2.info.status == "FINISHED" and it2.data.tags["hacrl.failures"] == "2"
    assert it2.data.tags["hacrl.last_failure"].startswith("exchange-and-align: InjectedFault")
    walls = lambda s: len(client.get_metric_history(it2.info.run_id, f"wall_s/{s}"))  # noqa: E731
    assert walls("generate-rollouts") == 1 and walls("exchange-and-align") == 3  # not redone / 2 failed + 1
    assert it2.data.tags["hacrl.prefect_flow_run_url"].endswith(f"/runs/flow-run/{resumed['id']}")
    assert _ran(_run(["dvc", "repro"], served).stdout) == []

    # redo an iteration: every stage runs again, DVC records it
    # README: hacrl iterate --iteration 2 --force
    out = _run(["hacrl", "iterate", "--iteration", "2", "--force"], served).stdout
    assert out.splitlines()[0].startswith("flow run iterate-it2 created") and "  ▶ generate-rollouts@it2" in out
    logs = _logs(served, _flow_runs(served)[-1]["id"])
    assert "generate-rollouts@it2: ran" in logs and "evaluate@it2: ran" in logs
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
    # hacrl iterate says so before it creates a flow run
    n = len(_api(served, "/flow_runs/filter", {}))
    p = _run(["hacrl", "iterate", "--iteration", "5"], served, check=False)
    assert p.returncode == 2 and "iteration: invalid value 5 (only 2 configured and done" in p.stderr
    assert len(_api(served, "/flow_runs/filter", {})) == n


def test_stop_ends_every_service(served):
    state = json.loads((served / ".services" / "services.json").read_text())
    _run(["hacrl", "stop", "--project", str(served)], served)
    for name, pgid in state["pgids"].items():
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    assert not (served / ".services.env").exists()
