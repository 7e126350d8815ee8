"""``hacrl agreement`` and the gate: how far a pool's agents agree on each other's text, measured
before any run, and a suite that refuses a pool its primary contrast cannot use (real sampling,
verification, THL and forward passes on the tiny pool)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hacrl.errors import ConfigError
from hacrl.study import agreement

HACPO = ["algorithm=hacpo"]


@pytest.fixture(scope="module")
def measured(workspaces):
    cfg = workspaces.config("agreement", *HACPO)
    import shutil

    shutil.copytree(workspaces.prepared(), cfg.layout.it(0))
    with workspaces.inside():
        res = agreement.measure(cfg, 0, prompts=12)
    return cfg, res


def test_every_edge_is_measured_in_both_units_with_the_first_and_last_cross_windows(measured):
    cfg, res = measured
    names = [a.name for a in cfg.agents]
    assert set(res["edges"]) == {f"{p}->{q}" for p in names for q in names if p != q}
    # HACPO's reference layout: the learner's own block first (its updates), then the peers'
    own_updates = cfg.rollout.prompts_per_iteration // (cfg.trainer.mini_batch_prompts * cfg.rollout.group_size
                                                        // cfg.samples_per_prompt)
    m = agreement.cross_updates(cfg, names[0])
    assert m[0] == own_updates and m == list(range(own_updates, own_updates * len(names)))
    for e in res["edges"].values():
        assert e["windows"]["hacpo_first"] == [pytest.approx(1 - 0.2 + 0.025 * m[0]), 1.0]
        assert e["windows"]["hacpo_last"][0] > e["windows"]["hacpo_first"][0]
        assert 0 < e["n"] <= 12 * cfg.samples_per_prompt
        for unit in agreement.UNITS:
            u = e[unit]
            assert u["q10"] <= u["q50"] <= u["q90"] and 0 <= u["inside_hacpo_first"] <= 1
            assert 0 <= u["weight_hacpo_first"] <= 1.0001
        assert math.isfinite(e["gap_nats_per_token"])


def test_a_ratio_is_the_learners_forward_against_the_producers_trace(measured, workspaces):
    """One edge recomputed by hand: the learner's mean log-prob of the peer's tokens (its own
    forward over the peer text it trains on) minus the producer's mean over its own tokens."""
    import torch

    from hacrl.agents.pool import load_agent, prompt_template
    from hacrl.agents.scoring import pack, response_span, token_logprobs
    from hacrl.config.schema import StreamConfig
    from hacrl.exchange.experience import LearnerView, subscribe

    cfg, res = measured
    a, b = cfg.agents
    with workspaces.inside():
        ps = agreement.dev_prompts(cfg, 12)
        published, toks, _ = agreement.sample_pool(cfg, 0, ps, cfg.samples_per_prompt)
    view = LearnerView(a.name, toks[a.name], prompt_template(a, toks[a.name]))
    rows = subscribe(published, view, [StreamConfig(record_type="trajectory", producers="all")], toks,
                     cfg.algorithm.thl).rows
    peer = rows[~rows["is_self"].astype(bool)].iloc[0]
    model = load_agent(a, cfg.layout.checkpoint(0, a.name)).model
    ids, attn, resp = pack([list(peer["input_prompt_ids"])], [list(peer["input_response_ids"])],
                           toks[a.name].pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(model, ids, attn, cfg.rollout.temperature, span=response_span(resp))[0][resp[0].bool()]
    want = float(lp.mean()) - float(peer["behavior_logprob_mean"])
    got = res["_log_ratios"][f"{b.name}->{a.name}"]["source_tokens"][0]
    assert got == pytest.approx(want, abs=1e-5)  # the same sampling seeds: the same first peer sample


def test_the_gate_names_each_failing_edge_and_refuses_no_edge(measured):
    _, res = measured
    failing = agreement.gate(res, "hacpo_first", min_share=1.01)
    assert len(failing) == len(res["edges"]) and all("%" in f for f in failing)
    assert agreement.gate(res, "hacpo_first", min_share=0.0) == []
    with pytest.raises(ConfigError, match="^gate: it names no edge"):
        agreement.gate(res, edges=[])


def test_a_pool_of_one_agent_has_no_edge(workspaces):
    cfg = workspaces.config("agreement-one", *HACPO)
    one = dataclasses.replace(cfg, agents=cfg.agents[:1])
    with pytest.raises(ConfigError, match=r"^agents: a pool of 1 agent .* has no edge"):
        agreement.measure(one, 0)


def test_a_suite_refuses_a_pool_that_fails_its_gate_before_any_run(workspaces, tmp_path, monkeypatch):
    """The tiny pool's agents disagree (none of their cross ratios near 1): the gated setting stops
    in one line with the figures, in the dry run and before the first run; --no-gate runs it and
    the report's first line says so."""
    from hacrl.study import compare
    from hacrl.study.suites import HACPO_GATE, SUITES

    from conftest import SMOKE

    setting = {"about": "the tiny pool", "base": [*SMOKE, "experiment.iterations=1"],
               "primary": SUITES["hacpo"]["settings"]["default"]["primary"], "plot": ["hacpo", "hacpo_cw0"],
               "contenders": ["hacpo", "hacpo_cw0"], "gate": {**HACPO_GATE, "prompts": 8}}
    monkeypatch.setitem(SUITES["hacpo"]["settings"], "tiny", setting)
    with pytest.raises(ConfigError, match=r"^hacpo/tiny: the pool fails its gate: under 30 % of cross samples inside "
                                          r"HACPO's first cross window on .*->.* \d+ %"):
        compare.run_suite("hacpo", 1, work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="tiny",
                          dry_run=True)
    plan = compare.run_suite("hacpo", 1, work_dir=tmp_path / "w2", reports_dir=tmp_path / "r", setting="tiny",
                             dry_run=True, no_gate=True)
    assert "gate not measured (--no-gate)" in plan and not (tmp_path / "w2").exists()  # a plan: nothing prepared
    monkeypatch.setattr(compare, "run_contender", lambda name, ovr, seed, out, warmup=0: {
        "contender": name, "seed": seed, "algorithm": name, "warmup": 0, "seconds": 1.0,
        "rollouts_per_agent_per_iteration": 8,
        "agents": {a: {"eval_accuracy": [0.1, 0.1], "rollouts": [0, 8], "train": [{"updates": 2}]}
                   for a in ("gpt2-a", "llama-b")}})
    with pytest.raises(ConfigError, match="fails its gate"):
        compare.run_suite("hacpo", 1, work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="tiny")
    compare.run_suite("hacpo", 1, work_dir=tmp_path / "w", reports_dir=tmp_path / "r", setting="tiny", no_gate=True)
    readme = (tmp_path / "r" / "hacpo" / "tiny" / "README.md").read_text()
    assert readme.startswith("**Run with --no-gate: the pool failed its gate**")
    assert "## Agreement at iteration 0 (the gate)" in readme


def test_the_figures_of_a_sample_set_are_its_quantiles_and_window_shares():
    lr = np.log(np.array([0.5, 0.84, 0.86, 0.95, 1.0, 1.2]))
    assert agreement._inside(lr, 0.85, 1.0) == pytest.approx(3 / 6)
    # inside: c sg[c]^alpha with alpha 1 -> c^2; outside 0
    assert agreement._effective_weight(lr, 0.85, 1.0, 1.0, 1.0) == pytest.approx((0.86**2 + 0.95**2 + 1.0) / 6)


def test_the_command_prepares_the_pool_prints_the_table_and_writes_the_figures(tmp_path):
    """`hacrl agreement` on the tiny pool: one row per edge, agreement.json / .md and a histogram
    per edge; a later iteration without a runs directory is one line."""
    import json
    import subprocess
    import sys

    from conftest import SMOKE

    def hacrl(*args):
        return subprocess.run([sys.executable, "-m", "hacrl.cli", "agreement", *SMOKE, "algorithm=hacpo",
                               "tracking.enabled=false", *args], cwd=tmp_path, capture_output=True, text=True)

    # README: hacrl agreement
    p = hacrl("--prompts", "6")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "| gpt2-a->llama-b |" in p.stdout and "| llama-b->gpt2-a |" in p.stdout
    out = tmp_path / "agreement" / "agreement-it0"
    res = json.loads((out / "agreement.json").read_text())
    assert res["prompts"] == 6 and len(list(out.glob("agreement_*.png"))) == 2
    bad = hacrl("--iteration", "2")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].startswith("hacrl: error: --iteration:")
