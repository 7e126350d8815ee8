"""The stage functions in one process on a miniature config (real transformers, DeepSpeed,
math-verify); the DVC path is tested in test_e2e_dvc.py."""

import pytest
from conftest import SMOKE, plain

from hacrl.errors import NonFiniteLossError
from hacrl.exchange.experience import read_records, write_records
from hacrl.pipeline import params, table
from hacrl.rl.rescues import RESCUED_FILE
from hacrl.storage import RunLayout, read_json


def smoke_config(tmp_path, extra=()):
    data = params.compose(SMOKE + list(extra))
    data["experiment"]["runs_dir"] = str(tmp_path / "runs")
    data["experiment"]["reports_dir"] = str(tmp_path / "reports")
    return params.from_dict(data)


@pytest.fixture(scope="module")
def pipeline(workspaces):
    """Preparation + iteration 1 up to capability stats (GSPO); the tests run where its data is."""
    cfg = workspaces.iteration("stages-gspo", "algorithm=gspo")
    with workspaces.inside() as root:  # data/ is relative to the working directory, as under dvc
        yield cfg, root


def test_rollout_records_carry_what_later_stages_need(pipeline):
    cfg, tmp = pipeline
    lay = RunLayout(cfg.experiment.runs_dir)
    for a in cfg.agents:
        ro = read_records(lay.rollouts(1) / f"{a.name}.parquet", "rollout")
        assert len(ro) == 16 * 4
        assert ro.groupby("prompt_id").size().eq(4).all()
        assert set(ro["finish_reason"]) <= {"stop", "length"}
        assert all(len(i) == len(lp) > 0 for i, lp in zip(ro["response_token_ids"], ro["response_logprobs"]))
        rw = read_records(lay.rewards(1) / f"{a.name}.parquet", "verdict")
        assert set(rw["verdict"]) <= {"correct", "wrong", "no_answer", "timeout", "gold_unparseable"}
    # the same prompts for every agent
    ids = [set(read_records(lay.rollouts(1) / f"{a.name}.parquet", "rollout")["prompt_id"]) for a in cfg.agents]
    assert ids[0] == ids[1]
    for a in cfg.agents:
        ex = read_records(lay.published(1, a.name, "trajectory"), "trajectory")
        assert (ex["schema_version"] == 2).all() and set(ex["producer"]) == {a.name}
        assert len(ex) == 16 * 4
    pool = read_json(lay.it(0) / "pool.json")
    assert all(p["round_trip_mismatch"] == 0 for p in pool.values())
    cap = read_json(lay.capability(1))
    assert set(cap["omega"]) == {a.name for a in cfg.agents} and len(cap["steps"]) == 1


def test_gspo_self_ratio_is_exactly_one_on_the_first_minibatch(pipeline, tmp_path):
    from hacrl.agents.pool import load_agent
    from hacrl.rl.step import train_learner

    cfg, _ = pipeline
    lay = RunLayout(cfg.experiment.runs_dir)
    a = cfg.agents[0]
    agent = load_agent(a, lay.checkpoint(0, a.name))
    batch = read_records(lay.learner_input(1, a.name), "learner_input")
    stats = train_learner(agent, batch, cfg, seed=0, prev_state=lay.train_state(0) / a.name,
                          out_state=tmp_path / "st")
    assert stats["first_ratio_mean"] == 1.0
    assert stats["updates"] == 2 and stats["total_updates"] == 2
    assert stats["gen_vs_train_logprob_maxdiff"] < 1e-4
    # the recovery state continues the update counter and restores the optimizer
    agent2 = load_agent(a, lay.checkpoint(0, a.name))
    stats2 = train_learner(agent2, batch, cfg, seed=1, prev_state=tmp_path / "st", out_state=tmp_path / "st2")
    assert stats2["total_updates"] == 4


def test_nan_loss_fails_the_stage_without_a_checkpoint(pipeline):
    cfg, tmp = pipeline
    lay = RunLayout(cfg.experiment.runs_dir)
    f = lay.learner_input(1, cfg.agents[0].name)
    good = read_records(f, "learner_input")
    bad = good.copy()
    bad["reward"] = float("nan")
    write_records(f, bad, "learner_input")
    try:
        with pytest.raises(NonFiniteLossError):
            table.run("update-policies", cfg, 1)
        assert not lay.checkpoints(1).exists() and not lay.train_state(1).exists()
        assert not list(lay.it(1).glob(".tmp-*")), "no half-written checkpoint may remain"
    finally:
        write_records(f, good, "learner_input")


def test_update_and_evaluate_finish_the_iteration(pipeline):
    cfg, _ = pipeline
    lay = RunLayout(cfg.experiment.runs_dir)
    stats = table.run("update-policies", cfg, 1)
    for a in cfg.agents:
        assert (lay.checkpoint(1, a.name) / "config.json").exists()
        assert stats[a.name]["updates"] == 2
    table.run("evaluate", cfg, 0)
    m = table.run("evaluate", cfg, 1)
    assert set(m["agents"]) == {a.name for a in cfg.agents}
    hist = read_json(lay.history(1))
    assert [h["iteration"] for h in hist["iterations"]] == [0, 1]


@pytest.mark.parametrize("algo,extra", [("hacpo", []), ("naive_share", []),
                                        ("hacpo", ["algorithm.minibatch_order=self_first"])])
def test_sharing_algorithms_train_on_retokenised_peer_records(pipeline, tmp_path, algo, extra):
    import shutil

    from transformers import AutoTokenizer

    cfg, _ = pipeline
    shutil.copytree(cfg.experiment.runs_dir, tmp_path / "runs")
    cfg_s = smoke_config(tmp_path, [f"algorithm={algo}", *extra])
    lay = RunLayout(cfg_s.experiment.runs_dir)
    ex = table.run("exchange-and-align", cfg_s, 1)
    a, b = cfg_s.agents
    inp = read_records(lay.learner_input(1, a.name), "learner_input")
    assert ex[a.name]["cross"] == (~inp["is_self"]).sum() == 64 and inp["is_self"].sum() == 64
    assert inp["is_self"].iloc[:64].all()  # the learner's own records first
    assert ex["thl"][b.name][a.name]["round_trip_mismatch"] == 0.0
    assert ex["thl"][b.name][a.name]["records"] == 64
    tok = AutoTokenizer.from_pretrained(lay.checkpoint(0, a.name))
    peer = inp[~inp["is_self"]].iloc[0]
    assert peer["producer"] == b.name and peer["learner"] == a.name
    assert list(peer["input_prompt_ids"]) == tok(a.template.replace("{problem}", peer["problem"]),
                                                 add_special_tokens=False)["input_ids"]
    assert tok.decode(peer["input_response_ids"], skip_special_tokens=True) == peer["response_text"]
    # the learner's input is a function of the published shards, its tokenizer and template alone
    from hacrl.agents.pool import load_tokenizer
    from hacrl.exchange.experience import LearnerView, subscribe

    published = {p.name: {k: read_records(lay.published(1, p.name, k), k)
                          for k in ("trajectory", "verified_success", "reward_stats")} for p in cfg_s.agents}
    toks = {p.name: load_tokenizer(p, lay.checkpoint(0, p.name)) for p in cfg_s.agents}
    again = subscribe(published, LearnerView(a.name, toks[a.name], a.template), cfg_s.algorithm.subscription,
                      toks, cfg_s.algorithm.thl).rows
    assert plain(again) == plain(inp)
    # THL: a peer's trace, aligned onto the learner's tokens, keeps its log-prob mass (the barely
    # trained tiny models also emit <unk>/<pad> mid-response: no text, so their mass is dropped)
    from hacrl.exchange.thl import token_spans

    checked = 0
    for row in inp[~inp["is_self"]].itertuples():
        assert len(row.behavior_logprobs_aligned) == len(row.input_response_ids)
        spans = token_spans(toks[row.producer], list(row.response_token_ids), row.response_text)
        if None not in spans[:-1]:
            lps = list(row.response_logprobs)
            if (cfg_s.algorithm.thl.peer_eos == "drop" and row.finish_reason == "stop"
                    and row.response_token_ids[-1] == toks[row.producer].eos_token_id):
                lps = lps[:-1]  # the producer's terminal EOS is not part of a cross sample
            assert sum(row.behavior_logprobs_aligned) == pytest.approx(sum(lps), abs=1e-6)
            checked += 1
    assert checked >= 16
    table.run("compute-capability-stats", cfg_s, 1)
    stats = table.run("update-policies", cfg_s, 1)[a.name]
    assert stats["cross_samples"] == 64
    if extra:  # self_first: ceil(P / B) = 2 updates; mini-batch 0 the 64 self samples, 1 the cross
        assert stats["updates"] == 2 and stats["first_ratio_mean"] == 1.0
        assert stats["per_update"]["cross_lower_bound"] == pytest.approx([0.8, 0.825])
        assert stats["per_update"]["cross_share"] == [0.0, 1.0]
        return
    # source_blocks (reference): n x P / B = 2 x 16 / 8 updates of 8 x 4 samples, the two self-only
    # updates first; m counts them all, so the first cross update has m = 2 (bound 0.85)
    assert stats["updates"] == 4 and stats["first_ratio_mean"] == 1.0
    assert stats[f"ratio/{b.name}/n"] == 64 and stats[f"ratio/{a.name}/n"] == 64
    assert 0 < stats[f"ratio/{b.name}/q10"] <= stats[f"ratio/{b.name}/q50"] <= stats[f"ratio/{b.name}/q90"]
    assert 0 <= stats["cross_gradient_share"] <= 1 and 0 <= stats["cross_objective_share"] <= 1
    if algo == "hacpo":
        assert stats["per_update"]["cross_share"] == [0.0, 0.0, 1.0, 1.0]
        assert len(stats["per_update"]["grad_norm"]) == 4 and all(g >= 0 for g in stats["per_update"]["grad_norm"])
        assert stats["per_update"]["cross_lower_bound"] == pytest.approx([0.8, 0.825, 0.85, 0.875])
        assert 0 < stats["cross_ratio_min"] <= stats["cross_ratio_mean"] <= stats["cross_ratio_max"]
        assert stats["cross_share"] == pytest.approx(0.5)
        assert 0 <= stats[f"ratio/{b.name}/clipped_below"] <= 1


def test_xgrpo_trains_on_its_own_rows_with_the_pools_reward_statistics(pipeline, tmp_path):
    import shutil

    cfg, _ = pipeline
    shutil.copytree(cfg.experiment.runs_dir, tmp_path / "runs")
    cfg_x = smoke_config(tmp_path, ["algorithm=xgrpo"])
    lay = RunLayout(cfg_x.experiment.runs_dir)
    ex = table.run("exchange-and-align", cfg_x, 1)
    a = cfg_x.agents[0]
    inp = read_records(lay.learner_input(1, a.name), "learner_input")
    assert inp["is_self"].all() and set(inp["producer"]) == {a.name} and len(inp) == 64  # strictly on-policy
    stats = read_records(lay.learner_input(1, a.name, "reward_stats"), "reward_stats")
    assert len(stats) == 16 * 2 and set(stats["producer"]) == {p.name for p in cfg_x.agents}
    assert ex[a.name]["side_reward_stats"] == 32
    table.run("compute-capability-stats", cfg_x, 1)
    out = table.run("update-policies", cfg_x, 1)[a.name]
    assert out["cross_samples"] == 0 and out["updates"] == 2 and out["first_ratio_mean"] == 1.0


@pytest.mark.parametrize("denominator", ["learner_snapshot", "thl_aligned_peer"])
def test_prp_pools_the_peers_rollouts_into_the_grpo_batch(pipeline, tmp_path, denominator):
    import shutil

    cfg, _ = pipeline
    shutil.copytree(cfg.experiment.runs_dir, tmp_path / "runs")
    cfg_p = smoke_config(tmp_path, ["algorithm=prp", f"algorithm.loss.peer_denominator={denominator}"])
    a, b = cfg_p.agents[0], cfg_p.agents[1]
    table.run("exchange-and-align", cfg_p, 1)
    table.run("compute-capability-stats", cfg_p, 1)
    out = table.run("update-policies", cfg_p, 1)[a.name]
    # 16 own + 16 peer prompt groups pooled per prompt: mini-batches of 8 prompts x 8 samples
    assert out["cross_samples"] == 64 and out["updates"] == 2 and out["first_ratio_mean"] == 1.0
    assert out[f"ratio/{b.name}/n"] == 64 and out[f"ratio/{a.name}/n"] == 64
    peer_first = out["per_update"]["peer_ratio_mean"][0]
    if denominator == "learner_snapshot":  # the learner's snapshot: the first update's ratio is 1
        assert peer_first == pytest.approx(1.0, abs=1e-5)
    else:  # the peer's own trace: how far the learner is from the policy that wrote the text
        assert abs(peer_first - 1.0) > 1e-3
    assert 0 <= out["cross_objective_share"] <= 1


def test_sgt_injects_a_peer_success_where_the_learner_failed_and_measures_if_it_stuck(pipeline, tmp_path):
    import shutil

    cfg, _ = pipeline
    shutil.copytree(cfg.experiment.runs_dir, tmp_path / "runs")
    cfg_s = smoke_config(tmp_path, ["algorithm=sgt"])
    lay = RunLayout(cfg_s.experiment.runs_dir)
    a, b = cfg_s.agents[0], cfg_s.agents[1]
    # set the verdicts: the learner a fails everything but one sample of prompt p3; the peer b
    # succeeds on every sample of p0..p3 only (a verdict file as verify-rewards writes it)
    prompts = sorted(set(read_records(lay.rewards(1) / f"{a.name}.parquet", "verdict")["prompt_id"]))
    for ag, ok in ((a, lambda r: r.prompt_id == prompts[3] and r.record_id.endswith("/0")),
                   (b, lambda r: r.prompt_id in prompts[:4])):
        path = lay.rewards(1) / f"{ag.name}.parquet"
        rw = read_records(path, "verdict")
        good = [ok(r) for r in rw.itertuples()]
        rw["verdict"] = ["correct" if g else "wrong" for g in good]
        rw["reward"] = [1.0 if g else 0.0 for g in good]
        write_records(path, rw, "verdict")
    ex = table.run("exchange-and-align", cfg_s, 1)
    inp = read_records(lay.learner_input(1, a.name), "learner_input")
    assert ex[a.name]["cross"] == 16 and (inp[~inp["is_self"]]["verdict"] == "correct").all()
    table.run("compute-capability-stats", cfg_s, 1)
    out = table.run("update-policies", cfg_s, 1)[a.name]
    # p3's peer successes are dropped before the update (a got p3 right once); one of the 4
    # successes of each of p0..p2 is injected
    assert out["rows_dropped_by_loss"] == 4 and out["cross_samples"] == 12
    assert out["rescued_prompts"] == prompts[:3] and out["rescues"] == 3
    assert out["own_all_wrong_prompts"] == 15 and out["trigger_rate"] == pytest.approx(3 / 16)
    assert out["rescued_so_far"] == {p: 1 for p in prompts[:3]}
    # the reward diagnostic is the learner's own (one success in its own samples); the pooled
    # figure counts the 12 injected candidates too
    n_own = int(inp["is_self"].sum())
    assert out["reward_mean"] == pytest.approx(1 / n_own)
    assert out["reward_mean_pooled"] == pytest.approx(13 / (n_own + 12))
    assert read_json(lay.train_state(1) / a.name / RESCUED_FILE) == out["rescued_so_far"]
    # the peer b has no all-wrong prompt with a success of a: nothing to inject
    b_out = read_json(lay.update_stats(1))[b.name]
    assert b_out["rescues"] == 0 and b_out["rescued_prompts"] == []
    table.run("evaluate", cfg_s, 0)
    ev = table.run("evaluate", cfg_s, 1)["agents"]
    assert ev[a.name]["rescued_now_n"] == 3 and 0 <= ev[a.name]["rescued_now_accuracy"] <= 1
    assert "rescued_before_n" not in ev[a.name] and "rescued_now_n" not in ev[b.name]


def test_a_first_update_writes_the_same_train_state_twice(pipeline, tmp_path):
    """The saved RNG state of a first step is seeded (numpy's and Python's generators start from OS
    entropy in every new process), so DVC sees the same train_state when a stage re-runs."""
    import hashlib
    import json
    import shutil
    import subprocess
    import sys

    cfg, _ = pipeline
    script = ("import json, sys\nfrom hacrl.pipeline import params, table\n"
              "d = params.compose(json.loads(sys.argv[1]))\n"
              "d['experiment']['runs_dir'], d['experiment']['reports_dir'] = sys.argv[2], sys.argv[3]\n"
              "table.run('update-policies', params.from_dict(d), 1)\n")
    digests = []
    for k in range(2):  # two processes, as two `dvc repro` runs would be
        runs = tmp_path / f"r{k}" / "runs"
        shutil.copytree(cfg.experiment.runs_dir, runs)
        p = subprocess.run([sys.executable, "-c", script, json.dumps(SMOKE + ["algorithm=gspo"]), str(runs),
                            str(tmp_path / f"r{k}" / "reports")], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        state = RunLayout(runs).train_state(1)
        digests.append({f.relative_to(state).as_posix(): hashlib.md5(f.read_bytes()).hexdigest()
                        for f in sorted(state.rglob("*")) if f.is_file()})
    assert digests[0] == digests[1] and len(digests[0]) >= 2


def test_dvc_metrics_hold_the_headline_per_agent():
    """`dvc metrics show` prints a few columns per agent; the rest stays in the history file."""
    from hacrl.pipeline.stages.evaluate import HEADLINE, headline_metrics

    full = {"iteration": 2, "agents": {"a": {"eval_accuracy": 0.5, "eval_stderr": 0.01, "eval_n": 1200,
                                             "by_level": {"1": 0.6}, "train_reward": 0.4, "entropy": 1.2},
                                       "b": {"eval_accuracy": 0.3, "eval_stderr": 0.02, "eval_n": 1200}}}
    h = headline_metrics(full)
    assert h == {"iteration": 2, "agents": {"a": {"eval_accuracy": 0.5, "eval_stderr": 0.01, "train_reward": 0.4},
                                            "b": {"eval_accuracy": 0.3, "eval_stderr": 0.02}}}
    assert set(HEADLINE) == {"eval_accuracy", "eval_stderr", "train_reward"}
