"""The real `dvc repro` on a miniature config: a full run, a no-op rerun, an extension by one
iteration, and a kill -9 in the middle of a stage followed by a resume at that stage."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SMOKE, dvc_workspace

from hacrl.storage import read_json

pytestmark = pytest.mark.slow

STAGES = ["generate-rollouts", "verify-rewards", "exchange-and-align", "compute-capability-stats",
          "update-policies", "evaluate"]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # lineage goes to the repo
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["HACRL_LOG_LEVEL"] = "WARNING"
    return env


def _run(args, cwd, check=True):
    p = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return dvc_workspace(tmp_path_factory.mktemp("e2e") / "repo", ("dvc.yaml", "conf", "src", ".gitignore", ".dvcignore"))


def _config(repo, *extra):
    _run([sys.executable, "-m", "hacrl.cli", "config", *SMOKE, *extra], repo)


def test_repro_runs_the_dag_then_nothing_then_only_new_iterations(repo):
    _config(repo)
    dag = _run(["dvc", "dag"], repo).stdout
    for s in STAGES:
        for it in (1, 2):
            assert f"{s}@it{it}" in dag
    # iteration 2's rollouts depend on iteration 1's checkpoints
    edges = _run(["dvc", "dag", "--dot"], repo).stdout
    assert re.search(r'"update-policies@it1"\s*->\s*"generate-rollouts@it2"', edges), edges

    first = _run(["dvc", "repro"], repo).stdout
    ran = _ran(first)
    assert ran[:3] == ["prepare-data", "prepare-pool", "evaluate-warmup"] or \
        set(ran[:3]) == {"prepare-data", "prepare-pool", "evaluate-warmup"}
    assert ran.index("generate-rollouts@it2") > ran.index("update-policies@it1")
    summary = read_json(repo / "reports" / "summary.json")
    assert summary["algorithm"] == "grpo"
    for name, a in summary["agents"].items():
        assert len(a["eval_accuracy"]) == 3 and all(0 <= x <= 1 for x in a["eval_accuracy"])
    for png in ("accuracy.png", "reward.png", "entropy.png"):
        assert (repo / "reports" / png).stat().st_size > 1000
    assert _run(["dvc", "plots", "show", "--json"], repo).returncode == 0

    second = _run(["dvc", "repro"], repo).stdout
    assert _ran(second) == [], second

    _config(repo, "experiment.iterations=3")
    third = _run(["dvc", "repro"], repo).stdout
    assert sorted(_ran(third)) == sorted([f"{s}@it3" for s in STAGES] + ["report"]), third
    assert len(read_json(repo / "reports" / "summary.json")["agents"]["gpt2-a"]["eval_accuracy"]) == 4

    # a trainer change makes the updates stale, not the rollouts that came before them
    _config(repo, "experiment.iterations=3", "trainer.lr=1e-4")
    stale = json.loads(_run(["dvc", "status", "--json"], repo).stdout)
    assert "update-policies@it1" in stale
    assert not {"prepare-pool", "generate-rollouts@it1", "verify-rewards@it1"} & set(stale)


def _outs(repo, stage):
    import yaml

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for o in lock["stages"][stage]["outs"]}


def test_mlflow_lineage_from_eval_metric_to_checkpoint_rollouts_and_config(repo):
    """`dvc repro` alone logged the lineage: walk it from the last evaluate run."""
    from mlflow.tracking import MlflowClient

    # the stages queued their records; `hacrl track` (what `make run` ends with) waits for them
    out = _run([sys.executable, "-m", "hacrl.cli", "track"], repo).stdout
    assert "0 still queued" in out, out
    assert not list((repo / "runs" / ".tracking" / "queue").glob("*.json"))
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("smoke").experiment_id
    evals = client.search_runs([exp], "tags.`hacrl.stage` = 'evaluate'", order_by=["attributes.start_time DESC"])
    last = evals[0]
    t = last.data.tags["hacrl.iteration"]
    assert t == "3" and last.info.status == "FINISHED"
    assert 0 <= last.data.metrics["gpt2-a/eval_accuracy"] <= 1
    # eval run -> the registered checkpoint it scored
    name, version = last.data.tags["hacrl.model_version.gpt2-a"].split("/")
    mv = client.get_model_version(name, version)
    ckpt_dir = f"runs/it{t}/checkpoints"
    assert mv.tags["iteration"] == t and mv.tags["dvc_out_hash"] == _outs(repo, f"update-policies@it{t}")[ckpt_dir]
    assert mv.source == (repo / ckpt_dir / "gpt2-a").resolve().as_uri()
    assert mv.tags["prefect_flow_run_id"] == "none"  # launched by dvc repro, not Prefect
    # checkpoint -> the update run that produced it -> the rollout shards it trained on
    upd = client.get_run(mv.run_id)
    assert upd.data.tags["hacrl.stage"] == "update-policies" and upd.data.tags["hacrl.iteration"] == t
    digests = {d.dataset.name: d.dataset.digest for d in upd.inputs.dataset_inputs}
    dir_md5 = _outs(repo, f"generate-rollouts@it{t}")[f"runs/it{t}/rollouts"]
    manifest = repo / ".dvc" / "cache" / "files" / "md5" / dir_md5[:2] / dir_md5[2:]
    dvc_files = {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())}
    for agent in ("gpt2-a", "llama-b"):
        assert digests[f"rollouts/it{t}/{agent}"] == dvc_files[f"{agent}.parquet"]
    assert digests.keys() >= {f"rewards/it{t}/gpt2-a", f"exchange/it{t}/learner-gpt2-a"}
    # -> the config: the iteration run holds the resolved config as params
    it_run = client.get_run(upd.data.tags["mlflow.parentRunId"])
    assert it_run.info.run_id == last.data.tags["mlflow.parentRunId"]
    assert it_run.data.params["algorithm.name"] == "grpo" and it_run.data.params["rollout.group_size"] == "4"
    assert it_run.data.params["agents.0.name"] == "gpt2-a"
    # per-agent nested runs with the iteration's metrics
    agent_runs = client.search_runs([exp], f"tags.mlflow.parentRunId = '{it_run.info.run_id}' "
                                           "and tags.`hacrl.kind` = 'agent'")
    assert {r.data.tags["hacrl.agent"] for r in agent_runs} == {"gpt2-a", "llama-b"}
    for r in agent_runs:
        assert {"eval_accuracy", "reward_mean", "train_entropy", "train_clip_frac",
                "rollout_tokens_per_s"} <= set(r.data.metrics)
        assert "train_kl_to_init" not in r.data.metrics  # no reference model (kl_coef 0): not computed, not 0


def test_kill_9_in_the_middle_of_a_stage_resumes_at_that_stage(repo):
    _config(repo, "experiment.iterations=4")
    it4 = repo / "runs" / "it4"
    proc = subprocess.Popen(["dvc", "repro"], cwd=repo, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    # kill the whole process group while update-policies is writing its checkpoints
    while time.time() < deadline and not list(it4.glob(".tmp-checkpoints-*")):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    assert list(it4.glob(".tmp-checkpoints-*")), "update-policies@it4 never started writing"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (it4 / "checkpoints").exists(), "a half-written checkpoint looks finished"

    rerun = _run(["dvc", "repro"], repo).stdout
    ran = _ran(rerun)
    assert ran[0] == "update-policies@it4", rerun
    assert "generate-rollouts@it4" not in ran and "verify-rewards@it4" not in ran
    assert not list(it4.glob(".tmp-*"))
    summary = read_json(repo / "reports" / "summary.json")
    assert all(len(a["eval_accuracy"]) == 5 for a in summary["agents"].values())
    assert _ran(_run(["dvc", "repro"], repo).stdout) == []

    # the resumed artifacts are those an uninterrupted run of the stage produces
    resumed = _outs(repo, "update-policies@it4")
    _run(["dvc", "repro", "--force", "--single-item", "update-policies@it4"], repo)
    assert _outs(repo, "update-policies@it4") == resumed
    assert _ran(_run(["dvc", "repro"], repo).stdout) == []


def test_a_fresh_workspace_elsewhere_reproduces_the_committed_lock_for_the_data(tmp_path):
    """The project's own pipeline files in another directory: `dvc repro prepare-data` writes the
    task data whose hashes the committed dvc.lock holds (nothing depends on the checkout's path
    or the clock). The pool's tokenizers are the same bytes in every process
    (tests/test_pool.py); the trained weights depend on the CPU's float arithmetic."""
    import yaml

    from conftest import ROOT

    ws = dvc_workspace(tmp_path / "elsewhere with space", ("dvc.yaml", "dvc.lock", "params.yaml", "conf", "src",
                                                            ".gitignore", ".dvcignore"))
    _run(["dvc", "repro", "--single-item", "prepare-data"], ws)
    mine = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]["prepare-data"]
    committed = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]["prepare-data"]
    assert mine["outs"] == committed["outs"]
    assert mine["deps"] == committed["deps"] and mine.get("params") == committed.get("params")
