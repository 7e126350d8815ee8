"""`hacrl compare --suite hacpo` at smoke size: every contender of the suite runs (same pool,
same prompts per seed) and the report is written with its tables, plots and findings."""

import json
import subprocess
import sys

import pytest

from conftest import SMOKE

from hacrl.compare import SUITES, auc

pytestmark = pytest.mark.slow


def test_auc_is_mean_accuracy_over_the_rollout_budget():
    assert auc([0, 10, 20], [0.0, 1.0, 1.0], 20) == pytest.approx(0.75)
    assert auc([0, 10, 20], [0.0, 1.0, 1.0], 10) == pytest.approx(0.5)  # equal budget cuts the curve
    assert auc([0, 20, 40], [0.0, 1.0, 1.0], 10) == pytest.approx(0.25)  # interpolated at the budget


def test_smoke_suite_writes_the_comparison_report(tmp_path):
    cmd = [sys.executable, "-m", "hacrl.cli", "--log-level", "WARNING", "compare", "--suite", "hacpo", "--seeds", "2",
           "--work-dir", str(tmp_path / "w"), "--reports-dir", str(tmp_path / "r"),
           *SMOKE, "experiment.iterations=1", "rollout.prompts_per_iteration=16", "trainer.mini_batch_prompts=8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "r" / "hacpo"
    res = json.loads((out / "results.json").read_text())
    contenders = set(SUITES["hacpo"]["contenders"])
    assert {r["contender"] for r in res["runs"]} == contenders and len(res["runs"]) == 2 * len(contenders)
    by = {(r["contender"], r["seed"]): r for r in res["runs"]}
    # gspo_x2 generates twice the rollouts per iteration; the others the same
    assert by[("gspo_x2", 0)]["rollouts_per_agent_per_iteration"] == 2 * by[("gspo", 0)]["rollouts_per_agent_per_iteration"]
    # the same prepared pool: every contender starts from the same iteration-0 accuracy
    start = {r["agents"]["gpt2-a"]["eval_accuracy"][0] for r in res["runs"]}
    assert len(start) == 1
    readme = (out / "README.md").read_text()
    assert "HACPO above GSPO for every agent" in readme and "ablation -stepwise" in readme
    for png in ("accuracy_vs_iterations.png", "accuracy_vs_rollouts.png"):
        assert (out / png).stat().st_size > 1000
    assert set(res["table"]["agents"]["gpt2-a"]) == contenders
