"""The real `dvc repro` on a miniature config: a full run, a no-op rerun, an extension by one
iteration, and a kill -9 in the middle of a stage followed by a resume at that stage."""

import csv
import io
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

from hacrl.hashes import dvc_hash
from hacrl.pipeline import table
from hacrl.storage import read_json

pytestmark = pytest.mark.slow

STAGES = list(table.iteration_stages())


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
    # README: dvc dag --mermaid
    mermaid = _run(["dvc", "dag", "--mermaid"], repo).stdout
    assert mermaid.startswith("flowchart") and max(map(len, mermaid.splitlines())) < 120
    edges = _run(["dvc", "dag", "--dot"], repo).stdout
    assert re.search(r'"update-policies@it1"\s*->\s*"generate-rollouts@it2"', edges), edges

    # `dvc repro` runs each stage as `hacrl stage NAME --iteration T` (dvc.yaml)
    # README: dvc repro
    # README: hacrl stage NAME -t T
    first = _run(["dvc", "repro"], repo).stdout
    ran = _ran(first)
    assert ran[:4] == ["external-input@none", "prepare-data", "prepare-pool", "evaluate-warmup"]
    assert ran.index("generate-rollouts@it2") > ran.index("update-policies@it1")
    # each iteration is evaluated before the next starts (its held-out figure exists as it ends)
    assert ran.index("evaluate@it1") < ran.index("generate-rollouts@it2"), ran
    summary = read_json(repo / "reports" / "summary.json")
    assert summary["algorithm"] == "grpo"
    for name, a in summary["agents"].items():
        assert len(a["eval_accuracy"]) == 3 and all(0 <= x <= 1 for x in a["eval_accuracy"])
    for png in ("accuracy.png", "reward.png", "entropy.png"):
        assert (repo / "reports" / png).stat().st_size > 1000
    assert _run(["dvc", "plots", "show", "--json"], repo).returncode == 0
    # README: dvc plots show
    _run(["dvc", "plots", "show"], repo)
    assert (repo / "dvc_plots" / "index.html").stat().st_size > 1000
    # README: dvc metrics show
    metrics = _run(["dvc", "metrics", "show"], repo).stdout
    final = read_json(repo / "reports" / "metrics.json")
    assert "reports/metrics.json" in metrics and "eval_accuracy.gpt2-a" in metrics and final["iteration"] == 2
    assert final["eval_accuracy"]["gpt2-a"] == round(summary["agents"]["gpt2-a"]["eval_accuracy"][-1], 4)

    second = _run(["dvc", "repro"], repo).stdout
    assert _ran(second) == [], second

    # a committed run, then a change: DVC's comparison commands read the committed metrics from git
    _run(["git", "add", "-A"], repo)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "2 iterations"], repo)
    _config(repo, "experiment.iterations=3")
    third = _run(["dvc", "repro"], repo).stdout
    assert sorted(_ran(third)) == sorted([f"{s}@it3" for s in STAGES] + ["report"]), third
    assert len(read_json(repo / "reports" / "summary.json")["agents"]["gpt2-a"]["eval_accuracy"]) == 4
    # README: dvc metrics diff main
    diff = _run(["dvc", "metrics", "diff", "HEAD"], repo).stdout
    assert re.search(r"reports/metrics\.json\s+iteration\s+2\s+3\s+1", diff), diff
    # the settings and metrics that differ; the changed dependencies' hashes (paths) and the
    # generated iteration table dropped
    # README: dvc exp show --only-changed --drop '.*/' --drop 'iterations\.'
    wide = {**_env(), "COLUMNS": "200"}
    shown = subprocess.run(["dvc", "exp", "show", "--no-pager", "--only-changed", "--drop", ".*/", "--drop",
                            r"iterations\."],
                           cwd=repo, env=wide, capture_output=True, text=True, check=True).stdout
    assert "experiment.iterations" in shown and " iteration " in shown and "…" not in shown, shown
    assert "runs/" not in shown and "iterations.it3" not in shown, shown
    rows = list(csv.DictReader(io.StringIO(_run(["dvc", "exp", "show", "--csv"], repo).stdout)))
    assert [r["rev"] for r in rows][0] == "workspace" and len(rows) == 2  # the workspace and the commit
    now = read_json(repo / "reports" / "metrics.json")
    assert float(rows[0]["eval_accuracy.gpt2-a"]) == now["eval_accuracy"]["gpt2-a"]
    assert float(rows[1]["eval_accuracy.gpt2-a"]) == final["eval_accuracy"]["gpt2-a"]  # from git alone
    assert (rows[0]["experiment.iterations"], rows[1]["experiment.iterations"]) == ("3", "2")
    # the settings alone (the iteration table is dvc.vars.yaml's)
    # README: dvc params diff --targets params.yaml
    pdiff = _run(["dvc", "params", "diff", "--targets", "params.yaml"], repo).stdout
    assert re.search(r"params\.yaml\s+experiment\.iterations\s+2\s+3", pdiff) and "iterations.it3" not in pdiff, pdiff

    # a trainer change makes the updates stale, not the rollouts that came before them
    _run(["git", "add", "-A"], repo)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "3 iterations"], repo)
    _config(repo, "experiment.iterations=3", "trainer.lr=1e-4")
    stale = json.loads(_run(["dvc", "status", "--json"], repo).stdout)
    # README: dvc params diff
    assert "trainer.lr" in _run(["dvc", "params", "diff"], repo).stdout
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
    # README: hacrl track
    out = _run([sys.executable, "-m", "hacrl.cli", "track"], repo).stdout
    assert "MLflow: every stage record is logged" in out and "still queued" not in out, out
    assert not list((repo / "runs" / ".tracking" / "queue").glob("*.json"))
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("smoke").experiment_id
    # the README's click path, each step the page a click opens from the URL the project prints
    # (the experiment's runs page)
    # one run per agent: its held-out accuracy is a line over iterations 0..3 (the runs page's chart)
    (agent,) = client.search_runs([exp], "tags.`hacrl.kind` = 'agent' and tags.`hacrl.agent` = 'gpt2-a'")
    hist = {m.step: m.value for m in client.get_metric_history(agent.info.run_id, "eval/accuracy")}
    assert sorted(hist) == [0, 1, 2, 3] and all(0 <= v <= 1 for v in hist.values())
    assert {"rollout/reward_mean", "train/entropy", "train/clip_frac", "rollout/tokens_per_s"} <= set(agent.data.metrics)
    assert "train/kl_to_init" not in agent.data.metrics  # no reference model (kl_coef 0): not computed, not 0
    # the point at step 3 -> the logged model of iteration 3's checkpoint, linked to the held-out set:
    # the Models tab (click 1), its row gpt2-a-it3 (click 2)
    (model,) = client.search_logged_models([exp], filter_string="name = 'gpt2-a-it3'")
    # its page shows the description (MLflow 3's model page shows no tags): checkpoint path, DVC hash
    note = model.tags["mlflow.note.content"]
    assert "runs/it3/checkpoints/gpt2-a" in note and dvc_hash(repo / "runs/it3/checkpoints/gpt2-a") in note
    (point,) = [m for m in model.metrics if m.key == "eval/accuracy"]
    assert (point.step, point.value, point.dataset_name) == (3, hist[3], "heldout")
    ckpt_dir = "runs/it3/checkpoints"
    assert model.tags["hacrl.checkpoint"] == f"{ckpt_dir}/gpt2-a"
    assert dvc_hash(repo / ckpt_dir) == _outs(repo, "update-policies@it3")[ckpt_dir]  # the hash DVC records
    assert model.tags["hacrl.dvc_hash"] == dvc_hash(repo / ckpt_dir / "gpt2-a")
    assert "hacrl.prefect_flow_run_id" not in model.tags  # launched by dvc repro, not Prefect
    assert client.get_model_version_by_alias("smoke.gpt2-a", "it3").source == f"models:/{model.model_id}"
    # -> the config it was trained with (the model's params)
    assert model.params["algorithm.name"] == "grpo" and model.params["rollout.group_size"] == "4"
    assert model.params["agents.0.name"] == "gpt2-a"
    # -> its source run, iteration 3, whose inputs are the shards it trained on (DVC's hashes): click 3
    src = client.get_run(model.source_run_id)
    assert src.info.run_name == "it3" and src.info.status == "FINISHED"
    digests = {d.dataset.name: d.dataset.digest for d in src.inputs.dataset_inputs}
    dir_md5 = _outs(repo, "generate-rollouts@it3")["runs/it3/rollouts"]
    manifest = repo / ".dvc" / "cache" / "files" / "md5" / dir_md5[:2] / dir_md5[2:]
    dvc_files = {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())}
    for name in ("gpt2-a", "llama-b"):
        assert digests[f"rollouts/it3/{name}"] == dvc_files[f"{name}.parquet"]
    assert digests.keys() >= {"rewards/it3/gpt2-a", "exchange/it3/learner-gpt2-a", "heldout"}
    # 1 experiment run, iterations 0..3, 2 agents: 7 runs, not one per stage
    assert len(client.search_runs([exp])) == 7


def test_a_damaged_checkpoint_is_refused_by_the_stage_that_reads_it_and_checkout_restores_it(repo):
    """`dvc repro --single-item` (what a Prefect task runs) on a damaged input: the stage fails
    naming the file (exit 2) and dvc.lock keeps the good hash; `dvc checkout` restores it."""
    ck = repo / "runs" / "it3" / "checkpoints" / "gpt2-a" / "model.safetensors"
    original = ck.read_bytes()
    damaged = bytearray(original)
    damaged[-100] ^= 0xFF
    ck.write_bytes(bytes(damaged))
    lock = (repo / "dvc.lock").read_text()
    p = _run(["dvc", "repro", "--single-item", "evaluate@it3"], repo, check=False)
    assert p.returncode != 0
    assert f"hacrl: error: {ck}: not what update-policies@it3 wrote (dvc.lock has another hash)" in p.stdout + p.stderr
    assert (repo / "dvc.lock").read_text() == lock  # the damaged hash was not recorded
    _run(["dvc", "checkout", "--force", "runs/it3/checkpoints"], repo)
    assert ck.read_bytes() == original
    assert _ran(_run(["dvc", "repro", "--single-item", "evaluate@it3"], repo).stdout) == []  # up to date again


def test_an_edited_lock_that_gives_an_iteration_another_iterations_rollouts_is_refused(repo):
    """Issue 29 (2), with the real DVC: dvc.lock edited to give generate-rollouts@it3's output the
    hash of runs/it2/rollouts; `dvc checkout` puts iteration 2's shards in runs/it3/rollouts and
    the lock's hash check passes, but the stage that reads them refuses (their manifest says what
    they are); the committed lock and a checkout restore everything."""
    import yaml

    text = (repo / "dvc.lock").read_text()
    lock = yaml.safe_load(text)
    two = lock["stages"]["generate-rollouts@it2"]["outs"][0]
    lock["stages"]["generate-rollouts@it3"]["outs"][0].update({k: two[k] for k in ("md5", "size", "nfiles") if k in two})
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    _run(["dvc", "checkout", "--force", "runs/it3/rollouts"], repo)
    assert json.loads((repo / "runs/it3/rollouts/_artifact.json").read_text())["artifact"] == "runs/it2/rollouts"
    edited = (repo / "dvc.lock").read_text()
    p = _run(["dvc", "repro", "--single-item", "verify-rewards@it3"], repo, check=False)
    assert p.returncode != 0
    assert ("hacrl: error: runs/it3/rollouts: holds runs/it2/rollouts (written by generate-rollouts@it2), not "
            "generate-rollouts@it3's runs/it3/rollouts") in p.stdout + p.stderr, p.stdout + p.stderr
    assert (repo / "dvc.lock").read_text() == edited  # nothing recorded on the swapped shards
    (repo / "dvc.lock").write_text(text)
    _run(["dvc", "checkout", "--force", "runs/it3/rollouts"], repo)
    assert _ran(_run(["dvc", "repro", "--single-item", "verify-rewards@it3"], repo).stdout) == []


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
    (tests/agents/test_pool.py); the trained weights depend on the CPU's float arithmetic."""
    import yaml
    from conftest import ROOT

    ws = dvc_workspace(tmp_path / "elsewhere with space", ("dvc.yaml", "dvc.lock", "params.yaml", "dvc.vars.yaml", "conf", "src",
                                                            ".gitignore", ".dvcignore"))
    _run(["dvc", "repro", "prepare-data"], ws)  # and the external-input stage before it
    mine = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]["prepare-data"]
    committed = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]["prepare-data"]
    assert mine["outs"] == committed["outs"]
    assert mine["deps"] == committed["deps"] and mine.get("params") == committed.get("params")


def test_a_fresh_clone_reproduces_the_committed_lock_and_leaves_git_clean(tmp_path):
    """The embedded experiment at a miniature size: run and committed in one workspace, then a
    git clone elsewhere (a space in its path, no DVC cache) runs `dvc repro` from scratch and
    `git status` stays clean: every output hash the lock holds came out the same."""
    a = dvc_workspace(tmp_path / "first", ("dvc.yaml", "conf", "src", ".gitignore", ".dvcignore"))
    _config(a, "experiment.iterations=1")
    _run(["dvc", "repro"], a)
    _run([sys.executable, "-m", "hacrl.cli", "track"], a)
    _run(["git", "add", "-A"], a)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "run"], a)
    assert _run(["git", "status", "--porcelain"], a).stdout == ""
    b = tmp_path / "clone with space"
    _run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    _run(["dvc", "config", "core.analytics", "false"], b)
    assert not (b / ".dvc" / "cache").exists() and not (b / "runs").exists()
    ran = _ran(_run(["dvc", "repro"], b).stdout)
    assert "prepare-pool" in ran and "update-policies@it1" in ran  # everything recomputed
    _run([sys.executable, "-m", "hacrl.cli", "track"], b)
    assert _run(["git", "status", "--porcelain"], b).stdout == "", _run(["git", "diff"], b).stdout[-3000:]


def test_hacrl_run_writes_what_dvc_tracks_in_one_process(tmp_path):
    # README: hacrl run
    ws = dvc_workspace(tmp_path / "inproc", ("dvc.yaml", "conf", "src", ".gitignore", ".dvcignore"))
    _config(ws, "experiment.iterations=1", "tracking.enabled=false")
    p = _run([sys.executable, "-m", "hacrl.cli", "run"], ws)
    assert set(json.loads(p.stdout)) >= {"prepare-pool", "update-policies", "evaluate", "report"}
    assert "dvc.lock does not record this run" in p.stderr
    assert len(read_json(ws / "reports" / "summary.json")["agents"]["gpt2-a"]["eval_accuracy"]) == 2
    assert not (ws / "dvc.lock").exists()


def test_editing_a_task_file_or_a_model_directory_makes_the_stages_that_read_it_stale(tmp_path):
    """Inputs outside the repository are dependencies too (dvc.yaml's external-input stages)."""
    from hacrl.config import build

    files = tmp_path / "tasks"
    files.mkdir()
    for name, k in (("train.jsonl", 1), ("held.jsonl", 2)):  # disjoint: an overlap is refused
        (files / name).write_text("".join(json.dumps({"problem": f"What is {i}+{k}?", "answer": str(i + k)}) + "\n"
                                          for i in range(60)))
    ws = dvc_workspace(tmp_path / "ws", ("dvc.yaml", "conf", "src", ".gitignore", ".dvcignore"))
    _config(ws, "data=files", f"data.train_path={files / 'train.jsonl'}", f"data.heldout_path={files / 'held.jsonl'}",
            "data.dev_size=10")
    assert set(build.read_yaml(ws / "dvc.vars.yaml")["external_inputs"]) == {"data-train", "data-heldout"}
    ran = _ran(_run(["dvc", "repro", "prepare-data"], ws).stdout)
    assert ran == ["external-input@data-heldout", "external-input@data-train", "prepare-data"] or \
        sorted(ran) == sorted(["external-input@data-heldout", "external-input@data-train", "prepare-data"])
    assert "prepare-data" not in json.loads(_run(["dvc", "status", "--json"], ws).stdout)
    with open(files / "train.jsonl", "a") as f:  # one more problem
        f.write(json.dumps({"problem": "What is 100+1?", "answer": "101"}) + "\n")
    stale = json.loads(_run(["dvc", "status", "--json"], ws).stdout)
    assert "external-input@data-train" in stale and "external-input@data-heldout" not in stale
    # an iterate flow run prepares first and chooses its iteration only after that
    from hacrl.ops.orchestration import plan_iteration

    plan = plan_iteration(ws)
    assert plan.iteration is None and plan.prepare and plan.inputs == ["external-input@data-train"]
    ran = _ran(_run(["dvc", "repro", "prepare-data"], ws).stdout)
    assert ran == ["external-input@data-train", "prepare-data"]
    assert read_json(ws / "data" / "tasks" / "manifest.json")["sizes"]["train"] == 51  # 61 rows less 10 for dev
