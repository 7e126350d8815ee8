"""`hacrl compare --suite hacpo` at smoke size: every contender of the suite runs (same pool,
same prompts per seed) and the report is written with its tables, plots and findings."""

import json
import subprocess
import sys

import pytest

from hacrl.study.compare import SUITES, auc, findings, paired_difference, verdict

from conftest import SMOKE

pytestmark = pytest.mark.slow


def test_auc_is_mean_accuracy_over_the_rollout_budget():
    assert auc([0, 10, 20], [0.0, 1.0, 1.0], 20) == pytest.approx(0.75)
    assert auc([0, 10, 20], [0.0, 1.0, 1.0], 10) == pytest.approx(0.5)  # equal budget cuts the curve
    assert auc([0, 20, 40], [0.0, 1.0, 1.0], 10) == pytest.approx(0.25)  # interpolated at the budget


@pytest.mark.parametrize("setting", sorted(SUITES["hacpo"]["settings"]))
def test_every_contender_of_every_setting_composes(setting):
    """Sizes the reference layout refuses, an unknown key or a misspelt preset would fail here at
    once rather than an hour into a suite run."""
    from hacrl.pipeline import params

    st = SUITES["hacpo"]["settings"][setting]
    for c in (SUITES["hacpo"]["all"] if setting == "default" else st["contenders"]):
        cfg = params.from_dict(params.compose(st["base"] + SUITES["hacpo"]["all"][c]))
        assert cfg.algorithm.kl_coef == 0.001 and cfg.rollout.prompts_per_iteration == 128, c
        if setting == "shared_tok":
            assert len({a.tokenizer.kind for a in cfg.agents}) == 1
        if setting == "worked":
            assert cfg.data.completion == "worked" and cfg.rollout.max_new_tokens >= 40


@pytest.mark.parametrize("setting", sorted(SUITES["mutual"]["settings"]))
def test_every_mutual_contender_composes(setting):
    from hacrl.pipeline import params

    st = SUITES["mutual"]["settings"][setting]
    # every contender, the on-demand probes included, composes in every setting
    for c in SUITES["mutual"]["all"]:
        cfg = params.from_dict(params.compose(st["base"] + SUITES["mutual"]["all"][c]))
        assert cfg.trainer.measure_kl_to_init and cfg.algorithm.kl_coef == 0 and cfg.rollout.prompts_per_iteration == 128
        if c == "sgt_nll0":
            assert cfg.algorithm.loss.nll_weight == 0
        if c.endswith("_lr1e4"):
            assert cfg.trainer.lr == 1e-4
    assert set(st["contenders"]) == {"grpo", "prp", "prp_thl", "xgrpo", "sgt", "sgt_nll0"}


def synthetic(contender, seed, curves, entropy=None, kl=None):
    """A run record as run_contender writes it, for agents a and b (``curves``: agent -> accuracies)."""
    return {"contender": contender, "seed": seed,
            "agents": {a: {"eval_accuracy": acc, "entropy": [None] + (entropy or [0.5] * (len(acc) - 1)),
                           "kl": [None] + (kl or [0.01] * (len(acc) - 1))} for a, acc in curves.items()}}


def test_claim_kinds_average_checkpoints_equal_and_signatures():
    res = []
    for s in range(3):
        e = 0.01 * s  # a seed effect shared by both contenders: pairing removes it
        res += [synthetic("grpo", s, {"a": [0.1, 0.20 + e, 0.30 + e], "b": [0.5, 0.50 + e, 0.60 + e]},
                          entropy=[0.6 + e, 0.6 + e], kl=[0.01, 0.02]),
                synthetic("sgt", s, {"a": [0.1, 0.25 + e, 0.30 + e + 0.001 * s], "b": [0.5, 0.48 + e, 0.64 + e]},
                          entropy=[0.5 + e, 0.5 + e], kl=[0.03, 0.04])]
    claims = [("mean", "sgt", "grpo", "average"), ("every", "sgt", "grpo", "every_checkpoint"),
              ("equal", "sgt", "grpo", "equal"), ("entropy", "grpo", "sgt", "entropy"), ("kl", "sgt", "grpo", "kl"),
              ("final", "sgt", "grpo")]
    f = {x["claim"]: x for x in findings(res, claims)}
    # mean over agents: (+0.001 s + 0.04) / 2 -> +2.05 points on average over seeds
    assert list(f["mean"]["differences"]) == ["all agents"]
    assert f["mean"]["differences"]["all agents"]["points"] == pytest.approx(2.05)
    # b is 2 points behind at iteration 1 on every seed: reversed there, so the claim fails
    assert f["every"]["differences"]["b"]["verdict"] == "reversed" and f["every"]["differences"]["b"]["points"] == -2.0
    assert f["every"]["differences"]["a"]["verdict"] == "holds" and f["every"]["differences"]["a"]["checkpoints"] == 2
    assert f["equal"]["differences"]["a"]["verdict"] == "holds" and f["equal"]["differences"]["b"]["verdict"] == "differs"
    assert f["entropy"]["differences"]["a"]["points"] == pytest.approx(0.1) and f["entropy"]["reproduces"]
    assert f["kl"]["differences"]["b"]["points"] == pytest.approx(0.02) and f["kl"]["reproduces"]
    assert f["final"]["differences"]["b"]["verdict"] == "holds"


def test_a_probe_is_added_to_a_finished_report(tmp_path, monkeypatch):
    """``--contenders`` adds runs to the setting's report instead of replacing it (the run itself
    is replaced by a stand-in here: this checks the bookkeeping, not the training)."""
    from hacrl.study import compare

    def fake_run(name, overrides, seed, out):
        acc = 0.1 + 0.01 * seed + (0.05 if name.startswith("hacpo") else 0.0)
        return {"contender": name, "seed": seed, "algorithm": name, "seconds": 1.0, "stage_seconds": {},
                "rollouts_per_agent_per_iteration": 8,
                "agents": {"a": {"eval_accuracy": [0.1, acc], "rollouts": [0, 8], "train": [{"updates": 2}]}}}

    monkeypatch.setattr(compare, "prepare_base", lambda overrides, out: None)
    monkeypatch.setattr(compare, "run_contender", fake_run)
    kw = dict(work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="shared_tok")
    compare.run_suite("hacpo", 2, **kw)
    compare.run_suite("hacpo", 2, contenders=["gspo_lr3e4", "hacpo_lr3e4"], **kw)
    res = json.loads((tmp_path / "r" / "hacpo" / "shared_tok" / "results.json").read_text())
    assert {r["contender"] for r in res["runs"]} == {*SUITES["hacpo"]["settings"]["shared_tok"]["contenders"],
                                                     "gspo_lr3e4", "hacpo_lr3e4"}
    assert len(res["runs"]) == 2 * 7
    lr = next(f for f in res["findings"] if f["claim"] == "HACPO above GSPO, both at lr 3e-4")
    assert lr["differences"]["a"]["points"] == 5.0
    # a different base (another pool) starts a new report
    compare.run_suite("hacpo", 2, ["rollout.group_size=4"], contenders=["gspo"], **kw)
    res = json.loads((tmp_path / "r" / "hacpo" / "shared_tok" / "results.json").read_text())
    assert {r["contender"] for r in res["runs"]} == {"gspo"}


def test_differences_are_paired_by_seed():
    def run(c, seed, acc):
        return {"contender": c, "seed": seed, "agents": {"a": {"eval_accuracy": [0.1, acc]}}}

    # b beats a by exactly 2 points on every seed, while the seeds themselves spread by 10 points:
    # paired, the difference is certain (s.e. 0); unpaired it would be lost in the spread
    res = [run("a", 0, 0.30), run("b", 0, 0.32), run("a", 1, 0.40), run("b", 1, 0.42), run("a", 2, 0.50), run("b", 2, 0.52)]
    d = paired_difference(res, "a", "b", "a")
    assert d["mean"] == pytest.approx(0.02) and d["se"] == pytest.approx(0, abs=1e-12) and d["seeds"] == 3
    assert verdict(d) == "holds" and verdict(paired_difference(res, "a", "a", "b")) == "reversed"
    noisy = [run("a", 0, 0.30), run("b", 0, 0.35), run("a", 1, 0.40), run("b", 1, 0.38)]
    d = paired_difference(noisy, "a", "b", "a")
    assert d["se"] == pytest.approx(0.035) and verdict(d) == "within noise"
    assert paired_difference(res, "a", "b", "missing") is None


def test_smoke_suite_writes_the_comparison_report(tmp_path):
    cmd = [sys.executable, "-m", "hacrl.cli", "--log-level", "WARNING", "compare", "--suite", "hacpo", "--seeds", "2",
           "--work-dir", str(tmp_path / "w"), "--reports-dir", str(tmp_path / "r"),
           *SMOKE, "experiment.iterations=1", "rollout.prompts_per_iteration=16", "trainer.mini_batch_prompts=8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "r" / "hacpo" / "default"
    res = json.loads((out / "results.json").read_text())
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
    assert 0 <= train["hacpo"]["ratio/llama-b/clipped_below"] <= 1
    readme = (out / "README.md").read_text()
    assert "HACPO above GSPO x2" in readme and "ablation -stepwise" in readme and "KL: coefficient 0.001" in readme
    for png in ("accuracy_vs_iterations.png", "accuracy_vs_rollouts.png"):
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
    res = json.loads((out / "results.json").read_text())
    by = {r["contender"]: r["agents"]["gpt2-a"] for r in res["runs"]}
    assert set(by) == {"grpo", "prp", "prp_thl", "xgrpo", "sgt", "sgt_nll0"}
    # SGT's control (lambda 0) is GRPO: the row filter and the weightless rescues change nothing
    assert by["sgt_nll0"]["eval_accuracy"] == by["grpo"]["eval_accuracy"]
    for c, r in by.items():  # the signatures of every contender, measured the same way
        assert r["entropy"][0] is None and r["entropy"][1] > 0 and r["kl"][1] >= 0, c
    assert "trigger_rate" in by["sgt"]["train"][0] and "peer_ratio_mean" in by["prp"]["train"][0]
    readme = (out / "README.md").read_text()
    assert "SGT at or above GRPO at every checkpoint" in readme and "all agents" in readme
    assert "Success-gated rescues" in readme
    for png in ("entropy_vs_iterations.png", "kl_vs_iterations.png"):
        assert (out / png).stat().st_size > 1000


def test_resume_reuses_the_runs_an_interrupted_suite_finished(tmp_path, monkeypatch):
    from hacrl.storage import write_json
    from hacrl.study import compare

    ran = []

    def fake_run(name, overrides, seed, out):
        ran.append((name, seed))
        return {"contender": name, "seed": seed, "agents": {"a": {"eval_accuracy": [0.1, 0.2], "rollouts": [0, 8]}}}

    monkeypatch.setattr(compare, "prepare_base", lambda overrides, out: None)
    monkeypatch.setattr(compare, "run_contender", fake_run)
    st = SUITES["hacpo"]["settings"]["shared_tok"]
    out = tmp_path / "w" / "hacpo" / "shared_tok"
    done = {"contender": "gspo", "seed": 0, "agents": {"a": {"eval_accuracy": [0.1, 0.3], "rollouts": [0, 8]}}}
    write_json(out / "gspo" / "seed0" / compare.RESULT_FILE,
               {**done, "overrides": st["base"] + SUITES["hacpo"]["all"]["gspo"] + ["experiment.seed=0"]})
    # another contender's file written with other overrides (another pool) is not reused
    write_json(out / "hacpo" / "seed0" / compare.RESULT_FILE, {**done, "contender": "hacpo", "overrides": ["x"]})
    compare.run_suite("hacpo", 1, work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="shared_tok",
                      contenders=["gspo", "hacpo"], resume=True)
    assert ran == [("hacpo", 0)]
    res = json.loads((tmp_path / "r" / "hacpo" / "shared_tok" / "results.json").read_text())
    assert {r["contender"]: r["agents"]["a"]["eval_accuracy"][-1] for r in res["runs"]} == {"gspo": 0.3, "hacpo": 0.2}
