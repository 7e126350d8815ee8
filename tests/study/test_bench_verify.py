"""The verify benchmark: its corpus verified by the pool as by serial ``verdict()``, and the suite
end to end at smoke size (real math-verify, no mocks)."""

import json

from hacrl.study.bench.verify import TIMEOUT_S, corpus
from hacrl.task.rewards import VerifierPool, verdict


def test_the_pool_gives_check_s_verdict_for_every_pair_of_the_corpus():
    items = corpus("smoke")
    assert {it.kind for it in items} >= {"integer", "fraction", "latex", "set_tuple", "wrong", "unparseable",
                                         "empty", "gold_unparseable", "pathological"}
    pairs = [(it.gold, it.response) for it in items]
    assert len(set(pairs)) < len(pairs)  # duplicates, as sampled rollouts have
    with VerifierPool(2, TIMEOUT_S) as pool:
        got = pool.verify(pairs)
        assert pool.killed == 0
    assert got == [verdict(g, r, TIMEOUT_S) for g, r in pairs]


def test_the_corpus_is_deterministic():
    assert corpus("smoke") == corpus("smoke")


def test_the_suite_runs_at_smoke_size(tmp_path):
    from hacrl.study.bench.runner import run_suite

    run_suite("verify", "smoke", reps=1, out_dir=tmp_path / "out", work_dir=tmp_path)
    res = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert set(res["contenders"]) == {"stage", "pool", "bare_pool", "serial"}
    assert all(c["units_per_s"] > 0 and c["units"] == res["work"]["answers"] for c in res["contenders"].values())
    goals = {(g["contender"], g["baseline"], g["target"]) for g in res["goals"]}
    assert ("stage", "bare_pool", 1.0) in goals
    assert all(isinstance(g["met"], bool) for g in res["goals"])
    for name in ("stage", "pool", "bare_pool"):
        assert res["contenders"][name]["extra"]["verdicts_differing_from_serial"] == 0, name
    extra = res["contenders"]["stage"]["extra"]
    assert extra["hung_verdict"] == "timeout" and 0.9 <= extra["hung_overshoot_s"] < 1.5
    assert (tmp_path / "out" / "verify.md").exists()
