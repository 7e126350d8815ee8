"""The real `dvc repro` on a miniature config: a full run, a no-op rerun, an extension by one
iteration, and a kill -9 in the middle of a stage followed by a resume at that stage."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SMOKE

from hacrl.storage import read_json

pytestmark = pytest.mark.slow

STAGES = ["generate-rollouts", "verify-rewards", "exchange-and-align", "compute-capability-stats",
          "update-policies", "evaluate"]


def _env():
    env = dict(os.environ)
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
def repo(tmp_path_factory, root):
    repo = tmp_path_factory.mktemp("e2e") / "repo"
    repo.mkdir()
    for item in ("dvc.yaml", "conf", "src", ".gitignore", ".dvcignore"):
        src = root / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, repo / item)
    _run(["git", "init", "-q"], repo)
    _run(["dvc", "init", "-q"], repo)
    _run(["dvc", "config", "core.analytics", "false"], repo)
    return repo


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
