"""The comparison protocol without training (the runs are stand-ins; tests/study/test_compare.py runs
real suites): suites declare their primary contrast; every contender composes; claims are paired
t tests, Holm-corrected, equivalence by TOST; the dev sweep chooses on dev with disjoint seeds;
warm-up pools vary with the seed; plots draw at most six distinguishable curves."""

import json

import pytest

from hacrl.errors import ConfigError, DataError
from hacrl.study import compare
from hacrl.study.claims import auc, findings, paired_diffs, primary, primary_line
from hacrl.study.report import MAX_LINES, STYLES, _train_figures, plot_groups
from hacrl.study.runstore import STORE_DIR, load_results, store_run, stored_run
from hacrl.study.suites import SUITES


def test_auc_is_mean_accuracy_over_the_rollout_budget():
    assert auc([0, 10, 20], [0.0, 1.0, 1.0], 20) == pytest.approx(0.75)
    assert auc([0, 10, 20], [0.0, 1.0, 1.0], 10) == pytest.approx(0.5)  # equal budget cuts the curve
    assert auc([0, 20, 40], [0.0, 1.0, 1.0], 10) == pytest.approx(0.25)  # interpolated at the budget


@pytest.mark.parametrize("suite, setting", [(s, x) for s in SUITES for x in SUITES[s]["settings"]])
def test_every_contender_of_every_setting_composes_and_the_primary_is_declared(suite, setting):
    """Sizes the reference layout refuses, an unknown key or a misspelt preset fail here at once
    rather than an hour into a suite run; the primary contrast's contenders are the setting's."""
    from hacrl.pipeline import params

    st = SUITES[suite]["settings"][setting]
    n = len(params.from_dict(params.compose(st["base"])).agents)
    for c in SUITES[suite]["all"]:
        cfg = params.from_dict(params.compose(st["base"] + compare.resolve(SUITES[suite]["all"][c], n)))
        compare.check_splits(cfg)  # a split its problem space cannot fill fails here, not at a run
        assert cfg.rollout.prompts_per_iteration == (16 if setting == "pretrained" else 128), c
        if suite == "hacpo":
            assert cfg.algorithm.kl_coef == 0.001, c
        else:
            assert cfg.trainer.measure_kl_to_init and cfg.algorithm.kl_coef == 0, c
        if c == "gspo_xn":  # the equal-rollout baseline of this pool, labelled as what runs
            assert cfg.algorithm.sample_multiplier == n and cfg.algorithm.name == f"gspo_x{n}"
        if c == "hacpo_cw0":
            assert cfg.algorithm.loss.cross_weight == 0
        if c == "sgt_oracle":
            assert [s.content for s in cfg.algorithm.subscription] == ["response", "gold"]
        if setting == "worked":
            assert cfg.data.completion == "worked" and cfg.rollout.max_new_tokens >= 40
    p = st["primary"]
    assert {p["better"], p["worse"]} <= set(st["contenders"]) and p["endpoint"] in ("auc", "final")
    assert set(st["plot"]) <= set(SUITES[suite]["all"]) and len(st["plot"]) <= MAX_LINES


@pytest.fixture(autouse=True)
def _no_gate(monkeypatch):
    """The runs here are stand-ins: no pool is prepared, so no agreement gate is measured (the
    gate is tested for real in test_agreement.py)."""
    monkeypatch.setattr(compare, "check_gate", lambda *a, **k: None)


def run(contender, seed, curves, entropy=None, kl=None, per_iter=8):
    """A run record as run_contender writes it (``curves``: agent -> accuracies)."""
    return {"contender": contender, "seed": seed,
            "agents": {a: {"eval_accuracy": acc, "rollouts": [per_iter * t for t in range(len(acc))],
                           "entropy": [None] + (entropy or [0.5] * (len(acc) - 1)),
                           "kl": [None] + (kl or [0.01] * (len(acc) - 1))} for a, acc in curves.items()}}


def test_differences_are_paired_by_seed():
    # b beats a by 2 points on every seed while the seeds spread by 10: paired, the difference is
    # certain; unpaired it would be lost in the spread
    res = [run("a", s, {"x": [0.1, acc]}) for s, acc in enumerate((0.30, 0.40, 0.50))]
    res += [run("b", s, {"x": [0.1, acc + 0.02]}) for s, acc in enumerate((0.30, 0.40, 0.50))]
    d = paired_diffs(res, "b", "a", lambda r: r["agents"]["x"]["eval_accuracy"][-1])
    assert d == pytest.approx([0.02] * 3)
    assert paired_diffs(res, "b", "missing", lambda r: 0.0) is None
    f = findings(res, [("b above a", "b", "a")], "final")[0]["differences"]["x"]
    assert f["verdict"] == "holds" and f["ci"] == [2.0, 2.0] and f["df"] == 2


def test_claims_are_t_tested_holm_corrected_and_equal_means_equivalent():
    res = []
    for s in range(4):
        e = 0.01 * s  # a seed effect shared by both contenders: pairing removes it
        jitter = (-1) ** s * 0.002
        res += [run("grpo", s, {"a": [0.1, 0.20 + e, 0.30 + e], "b": [0.5, 0.50 + e, 0.60 + e]},
                    entropy=[0.6 + e, 0.6 + e], kl=[0.01, 0.02]),
                run("sgt", s, {"a": [0.1, 0.25 + e + jitter, 0.35 + e - jitter], "b": [0.5, 0.48 + e + jitter, 0.601 + e + jitter]},
                    entropy=[0.5 + e, 0.5 + e + jitter], kl=[0.03, 0.04 + jitter])]
    claims = [("mean", "sgt", "grpo", "average"), ("every", "sgt", "grpo", "every_checkpoint"),
              ("equal", "sgt", "grpo", "equal"), ("entropy", "grpo", "sgt", "entropy"), ("kl", "sgt", "grpo", "kl"),
              ("final", "sgt", "grpo"), ("reversed", "grpo", "sgt")]
    f = {x["claim"]: x for x in findings(res, claims, "final")}
    # mean over agents: (+5 + 0.1) / 2 points
    assert list(f["mean"]["differences"]) == ["all agents"]
    assert f["mean"]["differences"]["all agents"]["points"] == pytest.approx(2.55)
    # b is 2 points behind at iteration 1: the claim "at every checkpoint" is not supported there
    assert f["every"]["differences"]["b"]["verdict"] == "not resolved" and f["every"]["differences"]["b"]["points"] == -2.0
    assert f["every"]["differences"]["a"]["verdict"] == "holds" and f["every"]["differences"]["a"]["checkpoints"] == 2
    # equal: b's 0.1-point difference is shown inside the 1-point margin; a's 5 points are not
    assert f["equal"]["differences"]["b"]["verdict"] == "equivalent"
    assert f["equal"]["differences"]["a"]["verdict"] == "not shown equivalent"
    assert f["entropy"]["differences"]["a"]["points"] == pytest.approx(0.1)
    assert f["final"]["differences"]["a"]["verdict"] == "holds" and f["reversed"]["differences"]["a"]["verdict"] == "reversed"
    # Holm: every adjusted p is at least the raw one, and the family shares one correction
    cells = [c for x in f.values() for c in x["differences"].values()]
    assert all(c["p_holm"] >= c["p"] - 1e-9 for c in cells)
    assert max(c["p_holm"] for c in cells) <= 1.0
    # the same differences alone are tested with less correction
    alone = findings(res, [claims[5]], "final")[0]["differences"]["b"]
    assert alone["p_holm"] == pytest.approx(alone["p"], abs=1e-4)


def test_one_seed_is_never_given_a_verdict():
    res = [run("a", 0, {"x": [0.1, 0.2]}), run("b", 0, {"x": [0.1, 0.5]})]
    cell = findings(res, [("b above a", "b", "a")], "final")[0]["differences"]["x"]
    assert cell["verdict"] == "one seed: not tested" and cell["points"] == 30.0
    p = primary(res, {"text": "b above a", "better": "b", "worse": "a", "endpoint": "final"})
    assert p["verdict"] == "one seed: not tested" and "not tested" in primary_line(p)


def test_the_primary_contrast_on_auc_with_its_interval_and_detectable_effect():
    res = []
    for s, gain in enumerate((0.02, 0.03, 0.01, 0.02, 0.025, 0.015)):
        res += [run("ctl", s, {"x": [0.2, 0.3, 0.4], "y": [0.1, 0.2, 0.2]}),
                run("hacpo", s, {"x": [0.2, 0.3 + gain, 0.4 + gain], "y": [0.1, 0.2 + gain, 0.2 + gain]})]
    p = primary(res, {"text": "H above C", "better": "hacpo", "worse": "ctl", "endpoint": "auc"})
    # AUC over 16 rollouts of (0, g, g) at x = 0, 8, 16: 3g/4
    assert p["mean_points"] == pytest.approx(75 * 0.02, abs=0.01) and p["df"] == 5 and p["verdict"] == "holds"
    assert p["ci_points"][0] > 0 and 0 < p["detectable_points"] < p["mean_points"]
    line = primary_line(p)
    assert line.startswith("**Primary contrast**") and "df 5" in line and "**holds**" in line


def test_plots_draw_at_most_six_distinguishable_curves_per_panel():
    assert len({(c, ls) for c, ls, _ in STYLES}) == len(STYLES) == MAX_LINES
    assert len({c for c, _, _ in STYLES}) == MAX_LINES and len({str(ls) for _, ls, _ in STYLES}) == MAX_LINES
    names = [f"c{i}" for i in range(14)]
    groups = plot_groups(names, ["c9", "c3", "missing"])
    assert groups[0] == ["c9", "c3"] and all(len(g) <= MAX_LINES for g in groups)
    assert sorted(sum(groups, [])) == sorted(names)


def _fake(ran):
    def fake_run(name, overrides, seed, out, warmup=0):
        ran.append((name, seed, warmup, tuple(overrides)))
        lr = next((o.split("=")[1] for o in overrides if o.startswith("trainer.lr=")), "5e-4")
        dev = "eval.split=dev" in overrides
        # on dev, 3e-4 is best for hacpo and 1e-4 for the others; held-out always favours hacpo
        good = {"hacpo": "3e-4"}.get(name.split("/")[1] if "/" in name else name, "1e-4")
        acc = 0.1 + 0.01 * seed + (0.05 if lr == good else 0.0) + (0.0 if dev else (0.05 if name.startswith("hacpo") else 0))
        return {"contender": name, "seed": seed, "algorithm": name, "warmup": warmup, "seconds": 1.0,
                "rollouts_per_agent_per_iteration": 8,
                "agents": {"a": {"eval_accuracy": [0.1, acc, acc], "rollouts": [0, 8, 16], "train": [{"updates": 2}]}}}
    return fake_run


def test_the_dev_sweep_chooses_on_dev_with_disjoint_seeds_and_the_report_says_so(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(compare, "prepare_base", lambda overrides, out, warmup=0: None)
    monkeypatch.setattr(compare, "run_contender", _fake(ran))
    compare.run_suite("hacpo", 3, work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="shared_tok",
                      contenders=["gspo", "hacpo", "hacpo_cw0"], tune=["trainer.lr=1e-4,3e-4"], tune_seeds=2, warmups=2)
    tuning_runs = [r for r in ran if r[0].startswith("tune/")]
    reported = [r for r in ran if not r[0].startswith("tune/")]
    assert len(tuning_runs) == 3 * 2 * 2 and all("eval.split=dev" in r[3] for r in tuning_runs)
    assert not any("eval.split=dev" in r[3] for r in reported)
    assert {r[1] for r in tuning_runs}.isdisjoint({r[1] for r in reported}) and {r[1] for r in reported} == {0, 1, 2}
    # the chosen lr reaches every reported run of its contender, after the contender's own overrides
    assert all(r[3][-2] == ("trainer.lr=3e-4" if r[0] == "hacpo" else "trainer.lr=1e-4") for r in reported
               if r[2] == 1) and all(r[3][-1] == ("trainer.lr=3e-4" if r[0] == "hacpo" else "trainer.lr=1e-4")
                                     for r in reported if r[2] == 0)
    # warm-up pools: seed s starts from pool s mod 2 (pool 1 with its own seed)
    assert {(r[1], r[2]) for r in reported} == {(0, 0), (1, 1), (2, 0)}
    assert all(("experiment.pool_seed=1" in r[3]) == (r[2] == 1) for r in ran)
    res = load_results(tmp_path / "r" / "hacpo" / "shared_tok")
    assert res["tuning"]["chosen"] == {"gspo": "trainer.lr=1e-4", "hacpo": "trainer.lr=3e-4",
                                       "hacpo_cw0": "trainer.lr=1e-4"} and res["warmups"] == 2
    readme = (tmp_path / "r" / "hacpo" / "shared_tok" / "README.md").read_text()
    assert readme.startswith("**Primary contrast**") and "Settings chosen on dev" in readme and "**" in readme


def test_a_variant_of_a_method_takes_the_methods_chosen_setting_without_its_own_sweep(tmp_path, monkeypatch):
    """An ablation tuned on its own would change two things at once; it takes HACPO's choice, and
    HACPO is swept for it even when HACPO itself is not reported."""
    ran = []
    monkeypatch.setattr(compare, "prepare_base", lambda overrides, out, warmup=0: None)
    monkeypatch.setattr(compare, "run_contender", _fake(ran))
    compare.run_suite("hacpo", 2, work_dir=tmp_path / "w", reports_dir=tmp_path / "r",
                      contenders=["gspo", "hacpo-adv", "hacpo-clip"], tune=["trainer.lr=1e-4,3e-4"], tune_seeds=1)
    assert sorted({r[0].split("/")[1] for r in ran if r[0].startswith("tune/")}) == ["gspo", "hacpo"]
    assert all(r[3][-1] == "trainer.lr=3e-4" for r in ran if r[0].startswith("hacpo-"))
    res = load_results(tmp_path / "r" / "hacpo" / "default")
    assert res["tuning"]["tuned_as"] == {"hacpo-adv": "hacpo", "hacpo-clip": "hacpo"}
    assert res["tuning"]["chosen"]["hacpo-adv"] == "trainer.lr=3e-4" and "hacpo-adv" not in res["tuning"]["dev_scores"]
    readme = (tmp_path / "r" / "hacpo" / "default" / "README.md").read_text()
    assert "hacpo-adv, hacpo-clip take hacpo's trainer.lr=3e-4" in readme


def test_a_bad_tune_item_is_refused_before_anything_runs(tmp_path):
    from hacrl.errors import ConfigError

    with pytest.raises(ConfigError, match="--tune"):
        compare.run_suite("hacpo", 1, work_dir=tmp_path, reports_dir=tmp_path, tune=["trainer.lr"], dry_run=True)
    plan = compare.run_suite("hacpo", 2, work_dir=tmp_path, reports_dir=tmp_path, setting="shared_tok",
                             tune=["trainer.lr=1e-4,3e-4"], dry_run=True)
    assert "24 dev runs" in plan and "primary: hacpo - hacpo_cw0 (auc)" in plan


def test_a_probe_is_added_to_a_finished_report(tmp_path, monkeypatch):
    """``--contenders`` adds runs to the setting's report instead of replacing it."""
    ran = []
    monkeypatch.setattr(compare, "prepare_base", lambda overrides, out, warmup=0: None)
    monkeypatch.setattr(compare, "run_contender", _fake(ran))
    kw = dict(work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="shared_tok")
    compare.run_suite("hacpo", 2, **kw)
    compare.run_suite("hacpo", 2, contenders=["gspo_lr3e4", "hacpo_lr3e4"], **kw)
    res = load_results(tmp_path / "r" / "hacpo" / "shared_tok")
    assert {r["contender"] for r in res["runs"]} == {*SUITES["hacpo"]["settings"]["shared_tok"]["contenders"],
                                                     "gspo_lr3e4", "hacpo_lr3e4"}
    assert len(res["runs"]) == 2 * (len(SUITES["hacpo"]["settings"]["shared_tok"]["contenders"]) + 2)
    # a different base (another pool) starts a new report
    compare.run_suite("hacpo", 2, ["rollout.group_size=4"], contenders=["gspo"], **kw)
    res = load_results(tmp_path / "r" / "hacpo" / "shared_tok")
    assert {r["contender"] for r in res["runs"]} == {"gspo"}


def test_resume_reuses_the_runs_an_interrupted_suite_finished(tmp_path, monkeypatch):
    from hacrl.storage import write_json

    ran = []
    monkeypatch.setattr(compare, "prepare_base", lambda overrides, out, warmup=0: None)
    monkeypatch.setattr(compare, "run_contender", _fake(ran))
    st = SUITES["hacpo"]["settings"]["shared_tok"]
    out = tmp_path / "w" / "hacpo" / "shared_tok"
    done = {"contender": "gspo", "seed": 0, "agents": {"a": {"eval_accuracy": [0.1, 0.3], "rollouts": [0, 8]}}}
    ovr = st["base"] + SUITES["hacpo"]["all"]["gspo"] + ["experiment.seed=0"]
    write_json(out / "gspo" / "seed0" / compare.RESULT_FILE,
               {**done, "overrides": ovr, "config": compare.config_key(compare._cfg(ovr, out / "runs", out / "reports"))})
    # another contender's file written with other overrides (another pool) is not reused
    write_json(out / "hacpo" / "seed0" / compare.RESULT_FILE, {**done, "contender": "hacpo", "overrides": ["x"]})
    compare.run_suite("hacpo", 1, work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="shared_tok",
                      contenders=["gspo", "hacpo"], resume=True)
    assert [r[0] for r in ran] == ["hacpo"]
    res = load_results(tmp_path / "r" / "hacpo" / "shared_tok")
    assert {r["contender"]: r["agents"]["a"]["eval_accuracy"][-1] for r in res["runs"]} == {"gspo": 0.3, "hacpo": pytest.approx(0.15)}


def test_two_contenders_that_ran_the_same_numbers_are_said_identical_not_tested():
    """SGT and its oracle on boxed answers inject the same text: every paired difference is 0, and
    the report says so instead of a degenerate interval and p-value."""
    from hacrl.study.claims import findings

    runs = [{"contender": c, "seed": s, "agents": {"a": {"eval_accuracy": [0.1, 0.2 + 0.01 * s], "rollouts": [0, 8]}}}
            for c in ("x", "y") for s in range(4)]
    (eq, up) = findings(runs, [("x equals y", "x", "y", "equal"), ("x above y", "x", "y")])
    assert eq["differences"]["a"]["verdict"] == "identical in every seed" and eq["reproduces"]
    assert up["differences"]["a"]["verdict"] == "identical in every seed" and not up["reproduces"]


def test_a_fresh_checkout_resumes_from_the_runs_kept_with_the_report(tmp_path, monkeypatch):
    """The scratch directory (pools, checkpoints) is gone on another machine; the finished runs kept
    in ``reports/<suite>/<setting>/runs/`` are reused on the same pool, rerun on another one."""
    from hacrl.storage import write_json

    ran = []
    pool = {"fp": "aaaa"}

    def fake_prepare(overrides, out, warmup=0):
        write_json(compare.base_dir(out, warmup) / "prepared.json", {"key": "k", "pool": pool["fp"]})

    def fake_run(name, overrides, seed, out, warmup=0):
        cfg = compare._cfg(overrides + [f"experiment.seed={seed}"], out / "runs", out / "reports")
        return {**_fake(ran)(name, overrides, seed, out, warmup), "pool": compare.pool_of(out, warmup),
                "config": compare.config_key(cfg)}

    monkeypatch.setattr(compare, "prepare_base", fake_prepare)
    monkeypatch.setattr(compare, "run_contender", fake_run)
    kw = dict(reports_dir=tmp_path / "r", setting="shared_tok", contenders=["gspo", "hacpo"], resume=True)
    compare.run_suite("hacpo", 2, work_dir=tmp_path / "w1", **kw)
    store = tmp_path / "r" / "hacpo" / "shared_tok" / STORE_DIR
    assert len(ran) == 4 and sorted(f.name for f in store.iterdir()) == [
        "gspo__seed0.json.gz", "gspo__seed1.json.gz", "hacpo__seed0.json.gz", "hacpo__seed1.json.gz"]
    first = (store / "gspo__seed0.json.gz").read_bytes()
    # a new scratch directory, the same pool: nothing reruns
    compare.run_suite("hacpo", 2, work_dir=tmp_path / "w2", **kw)
    assert len(ran) == 4 and (store / "gspo__seed0.json.gz").read_bytes() == first
    # the same pool prepared differently (another machine's arithmetic): every run again
    pool["fp"] = "bbbb"
    compare.run_suite("hacpo", 2, work_dir=tmp_path / "w3", **kw)
    assert len(ran) == 8
    # a default of conf/ changed (the same overrides compose another config): every run again
    real_key = compare.config_key
    monkeypatch.setattr(compare, "config_key", lambda cfg: "other" + real_key(cfg))
    compare.run_suite("hacpo", 2, work_dir=tmp_path / "w4", **kw)
    assert len(ran) == 12
    monkeypatch.setattr(compare, "config_key", real_key)
    compare.run_suite("hacpo", 2, work_dir=tmp_path / "w5", **kw)
    assert len(ran) == 16
    # a damaged kept file (here a git-LFS pointer) is done again, not a crash
    (store / "gspo__seed0.json.gz").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    compare.run_suite("hacpo", 2, work_dir=tmp_path / "w6", **kw)
    assert len(ran) == 17 and ran[-1][:2] == ("gspo", 0)
    # another base (a new report): the old report's runs leave the store with it
    compare.run_suite("hacpo", 1, ["rollout.group_size=4"], work_dir=tmp_path / "w3", **{**kw, "contenders": ["gspo"]})
    assert len(ran) == 18 and sorted(f.name for f in store.iterdir()) == ["gspo__seed0.json.gz"]


def test_the_report_says_each_models_step_and_cross_ratios_and_is_rewritten_without_runs(tmp_path):
    """The step-size section reads "small" per model (update-to-weight norm, KL per update), not
    from the lr; ``--report-only`` writes a finished setting's report again from results.json."""
    from hacrl.study.report import step_lines, write_report

    def with_train(r, peer=None):
        for a, ag in r["agents"].items():
            ag["kl"] = [None, 0.0, 0.02, 0.04]
            ag["train"] = [{"updates": 2, "update_to_weight": 1e-3 * (t + 1),
                            **({f"ratio/{peer}/q10": 0.2, f"ratio/{peer}/q50": 0.5, f"ratio/{peer}/q90": 0.9,
                                f"ratio/{peer}/clipped_below": 0.6, f"ratio/{peer}/clipped_above": 0.1,
                                f"ratio/{a}/q50": 1.0} if peer else {})} for t in range(3)]
        return r

    runs = [with_train(run(c, s, {"a": [0.1, 0.2, 0.3, 0.4]}), peer="b" if c == "hacpo" else None)
            for c in ("gspo", "hacpo", "hacpo_cw0") for s in range(2)]
    lines = "\n".join(step_lines(runs, ["a"]))
    # kl[3] = 0.04 was measured after the 2 + 2 updates of iterations 1 and 2
    assert "| gspo | a | 2.0 | 2.00e-03 | 0.0400 | 1.0e-02 | - |" in lines
    assert "| hacpo | a | 2.0 | 2.00e-03 | 0.0400 | 1.0e-02 | b: 0.20 / 0.50 / 0.90 (60% below, 10% above) |" in lines
    assert step_lines([run("gspo", 0, {"a": [0.1, 0.2]})], ["a"]) == []  # no training figures, no section
    st = SUITES["hacpo"]["settings"]["shared_tok"]
    out = tmp_path / "hacpo" / "shared_tok"
    write_report(runs, {**st, "claims": SUITES["hacpo"]["claims"]}, out, 60.0, st["base"], "hacpo", "shared_tok")
    # results.json lists the runs; each is kept once, in the store
    listed = json.loads((out / "results.json").read_text())["runs"]
    assert listed[0] == {"contender": "gspo", "seed": 0, "file": "runs/gspo__seed0.json.gz"}
    assert load_results(out)["runs"] == runs
    # a kept run keeps the pool's agent order (the report's panel and table order), not sorted keys
    store_run(tmp_path / "s", "x", 0, {"agents": {"qwen2-small": 1, "qwen2-large": 2}})
    assert list(stored_run(tmp_path / "s", "x", 0)["agents"]) == ["qwen2-small", "qwen2-large"]
    readme = out / "README.md"
    readme.write_text("stale")
    assert compare.rewrite_report("hacpo", "shared_tok", tmp_path) == out
    text = readme.read_text()
    assert text.startswith("**Primary contrast**") and "## Step size per model and the cross ratios" in text
    assert (tmp_path / "hacpo" / "README.md").exists()
    with pytest.raises(compare.ConfigError, match="does not exist"):
        compare.rewrite_report("hacpo", "worked", tmp_path)
    (out / "runs" / "hacpo__seed1.json.gz").unlink()
    with pytest.raises(compare.ConfigError, match="hacpo__seed1.json.gz: the run results.json lists is missing"):
        compare.rewrite_report("hacpo", "shared_tok", tmp_path)
    with pytest.raises(compare.ConfigError, match="invalid value"):
        compare.rewrite_report("hacpo", "nope", tmp_path)


def test_a_setting_with_few_seeds_lists_every_runs_curve_and_cross_share(tmp_path):
    """``per_iteration: True`` (the pretrained pair): every run's held-out curve, the peers' share
    of its gradient per iteration (``-`` without peers) and the KL after each iteration."""
    from hacrl.study.report import iteration_lines, write_report

    runs = [run(c, s, {"a": [0.1, 0.2, 0.3]}, kl=[0.0, 0.25]) for c in ("gspo", "hacpo") for s in range(2)]
    for r in runs:
        peer = {"ratio/b/q50": 0.3} if r["contender"] == "hacpo" else {}
        r["agents"]["a"]["train"] = [{"cross_gradient_share": 0.108 * (1 - t), **peer} for t in range(2)]
    text = "\n".join(iteration_lines(runs, ["a"]))
    assert "| contender | seed | acc. it0 | acc. it1 | acc. it2 | cross share it1 | cross share it2 | KL after it1 |" in text
    assert "| hacpo | 1 | 10.0 | 20.0 | 30.0 | 10.8 | 0.0 | 0.250 |" in text
    assert "| gspo | 0 | 10.0 | 20.0 | 30.0 | - | - | 0.250 |" in text
    st = SUITES["hacpo"]["settings"]
    assert st["pretrained"]["per_iteration"] and not st["default"].get("per_iteration")
    for setting, listed in (("pretrained", True), ("default", False)):
        out = write_report(runs, {**st[setting], "claims": []}, tmp_path / setting, 1.0, [], "hacpo", setting)
        assert ("## Every run, iteration by iteration" in (out / "README.md").read_text()) == listed


def test_a_split_the_problem_space_cannot_fill_fails_before_any_run(tmp_path, monkeypatch):
    """Numbers up to 20 give the pretrained pair's dev split 35 distinct problems: asking for 48
    fails in the dry run and before the first pool is prepared, naming the split."""
    monkeypatch.setattr(compare, "prepare_base", lambda *a, **k: pytest.fail("prepared a pool"))
    for dry in (True, False):
        with pytest.raises(DataError, match="dev split .* fewer than 48 distinct problems"):
            compare.run_suite("hacpo", 1, ["data.dev_size=48"], work_dir=tmp_path / "w", reports_dir=tmp_path / "r",
                              setting="pretrained", dry_run=dry)
    assert "every config valid" in compare.run_suite("hacpo", 1, work_dir=tmp_path / "w", setting="pretrained",
                                                     dry_run=True)


def test_a_setting_can_name_its_own_variants_that_take_a_methods_setting(tmp_path, monkeypatch):
    """The pretrained pair sweeps HACPO and GSPO only: its control takes HACPO's lr and GSPO x n
    GSPO's, which the setting declares beside the suite's own pairs."""
    ran = []
    monkeypatch.setattr(compare, "prepare_base", lambda overrides, out, warmup=0: None)
    monkeypatch.setattr(compare, "run_contender", _fake(ran))
    compare.run_suite("hacpo", 1, work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="pretrained",
                      tune=["trainer.lr=1e-4,3e-4"], tune_seeds=1)
    assert sorted({r[0].split("/")[1] for r in ran if r[0].startswith("tune/")}) == ["gspo", "hacpo"]
    res = load_results(tmp_path / "r" / "hacpo" / "pretrained")
    assert res["tuning"]["tuned_as"] == {"hacpo_cw0": "hacpo", "gspo_xn": "gspo"}
    # the fake's dev favours 3e-4 for hacpo and 1e-4 for every other name: a control swept on its
    # own would take 1e-4
    assert res["tuning"]["chosen"] == {"gspo": "trainer.lr=1e-4", "hacpo": "trainer.lr=3e-4",
                                       "gspo_xn": "trainer.lr=1e-4", "hacpo_cw0": "trainer.lr=3e-4"}
    reported = {r[0]: r[3] for r in ran if not r[0].startswith("tune/")}
    assert "trainer.lr=3e-4" in reported["hacpo_cw0"] and "trainer.lr=1e-4" in reported["gspo_xn"]


def test_the_training_cell_shows_the_on_policy_kl_not_the_loss_term():
    """The loss's KL term is averaged over a step's mini-batches on samples the old policy drew;
    once a policy has moved far it is heavy-tailed (Gemma-3 on the pretrained pair: 7.3e6 nats in
    one iteration where the on-policy KL was under 2). The cell prints the on-policy measure."""
    both = _train_figures({"train": {"kl_to_init": 7.3e6, "kl_init_before_step": 0.48}}, "a")
    assert "KL to init 0.4800" in both and "7300000" not in both
    # a run that measured only the loss's term says so
    assert "KL term 0.0100" in _train_figures({"train": {"kl_to_init": 0.01}}, "a")


def test_a_per_agent_sweep_gives_each_agent_the_value_of_its_own_best_dev_accuracy(tmp_path, monkeypatch):
    """``--tune-per-agent``: one lr does not suit two models; each agent takes its own best as its
    own setting (``agents.<name>.trainer.lr``), from the same dev runs."""
    ran = []

    def fake_run(name, overrides, seed, out, warmup=0):
        ran.append((name, seed, overrides))
        lr = next((o.split("=")[1] for o in overrides if o.startswith("trainer.lr=")), None)
        # on dev the small model likes 3e-4, the large one 1e-4
        a, b = (0.3, 0.1) if lr == "3e-4" else (0.1, 0.3)
        return {"contender": name, "seed": seed, "algorithm": name, "warmup": warmup, "seconds": 1.0,
                "rollouts_per_agent_per_iteration": 8,
                "agents": {n: {"eval_accuracy": [0.1, v, v], "rollouts": [0, 8, 16], "train": [{"updates": 2}]}
                           for n, v in (("qwen2-small", a), ("qwen2-large", b))}}

    monkeypatch.setattr(compare, "prepare_base", lambda overrides, out, warmup=0: None)
    monkeypatch.setattr(compare, "run_contender", fake_run)
    compare.run_suite("hacpo", 1, work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="shared_tok",
                      contenders=["gspo", "hacpo_cw0"], tune=["trainer.lr=1e-4,3e-4"], tune_seeds=1,
                      tune_per_agent=True)
    res = load_results(tmp_path / "r" / "hacpo" / "shared_tok")
    assert res["tuning"]["per_agent"]["gspo"] == {"qwen2-small": "trainer.lr=3e-4", "qwen2-large": "trainer.lr=1e-4"}
    reported = [r for r in ran if not r[0].startswith("tune/")]
    for name, _, ovr in reported:
        assert "agents.qwen2-small.trainer.lr=3e-4" in ovr and "agents.qwen2-large.trainer.lr=1e-4" in ovr, ovr
    readme = (tmp_path / "r" / "hacpo" / "shared_tok" / "README.md").read_text()
    assert "Per agent" in readme and "| gspo | qwen2-large |" in readme
    # a setting no agent has on its own is refused before anything runs
    with pytest.raises(ConfigError, match=r"^--tune-per-agent: trainer.epochs is not a per-agent setting"):
        compare.run_suite("hacpo", 1, work_dir=tmp_path / "w2", reports_dir=tmp_path / "r2", setting="shared_tok",
                          tune=["trainer.epochs=1,2"], tune_per_agent=True, dry_run=True)
