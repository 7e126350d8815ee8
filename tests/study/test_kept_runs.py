"""The runs kept with the reports stay theirs: each one's overrides, composed with today's code,
give the config digest it was kept under, so ``hacrl compare --resume`` reuses it. Settings added
since a run was kept state the value it ran with (``algorithm.kl_clamp=null``: no clamp) or are
neutral at their default; sections without effect on results (engines, orchestration, tracking)
are not in the digest."""

from __future__ import annotations

import gzip
import json

import pytest

from conftest import ROOT

from hacrl.study.compare import _cfg, config_key
from hacrl.study.suites import BEFORE_CLAMP, SUITES

KEPT = sorted(ROOT.glob("reports/*/*/runs/*.json.gz"))


def _key(overrides, tmp_path):
    return config_key(_cfg(overrides, tmp_path / "runs", tmp_path / "reports"))


def _runs():
    for f in KEPT:
        run = json.loads(gzip.open(f).read())
        if run.get("overrides") is not None:  # the pre-protocol reports kept no overrides
            yield f, run


def test_there_are_kept_runs_to_check():
    assert sum(1 for _ in _runs()) > 300


@pytest.mark.parametrize("setting", [f"{s}/{t}" for s, spec in SUITES.items() for t in spec["settings"]])
def test_every_kept_run_composes_to_the_digest_it_was_kept_under(setting, tmp_path):
    suite, name = setting.split("/")
    base = SUITES[suite]["settings"][name]["base"]
    runs = [(f, r) for f, r in _runs() if f.parent.parent.name == name and f.parents[2].name == suite]
    for f, run in runs:
        assert run["overrides"][:len(base)] == base, f"{f.name}: not this setting's overrides"
        assert _key(run["overrides"], tmp_path) == run["config"], f"{f.name}: another config than it was kept under"
    if any(o.startswith("algorithm.kl_coef=") and o != "algorithm.kl_coef=0" for o in base) and runs:
        # it ran unclamped: with the clamp (today's default) it would be another run
        f, run = runs[0]
        clamped = [o for o in run["overrides"] if o not in BEFORE_CLAMP]
        assert _key(clamped, tmp_path) != run["config"]


def test_settings_without_effect_on_results_leave_the_digest_alone(tmp_path):
    base = ["algorithm=gspo"]
    k = _key(base, tmp_path)
    assert _key([*base, "engines.vllm.threads=3", "tracking.enabled=false", "orchestration.retries=4"], tmp_path) == k
    assert _key([*base, "algorithm.kl_clamp=null"], tmp_path) != k  # the default clamps: another run
    assert _key([*base, "trainer.lr=1e-3"], tmp_path) != k
