"""`hacrl compare` at smoke size, for real: every contender of a suite runs (same pool, same
prompts per seed) and the report is written with its primary contrast, tables, plots and claims.
The protocol's bookkeeping and statistics without training: tests/study/test_protocol.py."""

import subprocess
import sys

import pytest
from conftest import SMOKE

from hacrl.study.runstore import load_results
from hacrl.study.suites import SUITES

pytestmark = pytest.mark.slow


def test_smoke_suite_writes_the_comparison_report(tmp_path):
    # the barely warmed-up tiny pool fails HACPO's gate (0 % inside the window): the report's
    # machinery runs under --no-gate, which its first line states
    cmd = [sys.executable, "-m", "hacrl.cli", "--log-level", "WARNING", "compare", "--suite", "hacpo", "--seeds", "2",
           "--no-gate", "--work-dir", str(tmp_path / "w"), "--reports-dir", str(tmp_path / "r"),
           *SMOKE, "experiment.iterations=1", "rollout.prompts_per_iteration=16", "trainer.mini_batch_prompts=8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "r" / "hacpo" / "default"
    res = load_results(out)
    contenders = set(SUITES["hacpo"]["settings"]["default"]["contenders"])
    assert {r["contender"] for r in res["runs"]} == contenders and len(res["runs"]) == 2 * len(contenders)
    by = {(r["contender"], r["seed"]): r for r in res["runs"]}
    # gspo_x2 generates twice the rollouts per iteration; the others the same
    assert by[("gspo_x2", 0)]["rollouts_per_agent_per_iteration"] == 2 * by[("gspo", 0)]["rollouts_per_agent_per_iteration"]
    # the same prepared pool: every contender starts from the same iteration-0 accuracy
    start = {r["agents"]["gpt2-a"]["eval_accuracy"][0] for r in res["runs"]}
    assert len(start) == 1
    # the suite's KL reaches every contender; the reference layout doubles HACPO's updates
    train = {c: by[(c, 0)]["agents"]["gpt2-a"]["train"][0] for c in contenders}
    assert all(t["kl_to_init"] >= 0 for t in train.values())
    assert train["gspo"]["updates"] == 2 and train["hacpo"]["updates"] == 4 and train["hacpo_self_first"]["updates"] == 2
    assert train["gspo_x2"]["updates"] == 4  # half the prompts per update
    # HACPO's control keeps HACPO's updates; GSPO x n (two agents here) generates n times GSPO's
    # rollouts in GSPO's mini-batches
    assert train["hacpo_cw0"]["updates"] == train["hacpo"]["updates"] and train["gspo_xn"]["updates"] == 2
    assert by[("gspo_xn", 0)]["rollouts_per_agent_per_iteration"] == 2 * by[("gspo", 0)]["rollouts_per_agent_per_iteration"]
    assert by[("gspo_xn", 0)]["algorithm"] == "gspo_x2" and by[("hacpo_cw0", 0)]["algorithm"] == "hacpo"
    assert 0 <= train["hacpo"]["ratio/llama-b/clipped_below"] <= 1
    readme = (out / "README.md").read_text()
    first, rest = readme.split("\n", 1)
    assert first.startswith("**Run with --no-gate: the pool failed its gate**"), first
    assert "**Primary contrast** (declared before the runs): HACPO above its control" in rest and "df 1" in readme
    assert res["primary"]["seeds"] == 2 and res["primary"]["verdict"] in ("holds", "reversed", "not resolved")
    assert "HACPO above GSPO x2" in readme and "ablation -stepwise" in readme and "KL: coefficient 0.001" in readme
    for png in ("accuracy_vs_iterations.png", "accuracy_vs_rollouts.png", "accuracy_vs_rollouts_2.png"):
        assert (out / png).stat().st_size > 1000
    assert set(res["table"]["agents"]["gpt2-a"]) == contenders
    index = (tmp_path / "r" / "hacpo" / "README.md").read_text()
    assert "## `default`" in index and "naive sharing below GSPO" in index


def test_smoke_mutual_suite_writes_signatures_and_rescues(tmp_path):
    cmd = [sys.executable, "-m", "hacrl.cli", "--log-level", "WARNING", "compare", "--suite", "mutual", "--seeds", "1",
           "--work-dir", str(tmp_path / "w"), "--reports-dir", str(tmp_path / "r"),
           *SMOKE, "experiment.iterations=1", "rollout.prompts_per_iteration=16", "trainer.mini_batch_prompts=8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "r" / "mutual" / "default"
    res = load_results(out)
    by = {r["contender"]: r["agents"]["gpt2-a"] for r in res["runs"]}
    assert set(by) == {"grpo", "prp", "prp_thl", "xgrpo", "sgt", "sgt_nll0", "sgt_oracle"}
    # SGT's control (lambda 0) is GRPO: the row filter and the weightless rescues change nothing
    assert by["sgt_nll0"]["eval_accuracy"] == by["grpo"]["eval_accuracy"]
    for c, r in by.items():  # the signatures of every contender, measured the same way
        assert r["entropy"][0] is None and r["entropy"][1] > 0 and r["kl"][1] >= 0, c
    assert "trigger_rate" in by["sgt"]["train"][0] and "peer_ratio_mean" in by["prp"]["train"][0]
    # the oracle fires on the same gate (a peer's verified success), injecting the gold completion
    assert "trigger_rate" in by["sgt_oracle"]["train"][0]
    readme = (out / "README.md").read_text()
    assert "SGT at or above GRPO at every checkpoint" in readme and "all agents" in readme
    assert "Success-gated rescues" in readme
    for png in ("entropy_vs_iterations.png", "kl_vs_iterations.png"):
        assert (out / png).stat().st_size > 1000
