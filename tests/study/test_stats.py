"""The comparison statistics against scipy's own tests and hand-worked values."""

from __future__ import annotations

import pytest
from scipy import stats

from hacrl.study.stats import detectable_effect, holm, paired_t, seeds_for, tost


def test_paired_t_matches_scipys_one_sample_t_test():
    diffs = [1.2, -0.4, 2.5, 0.9, 1.7, 0.3]
    r = paired_t(diffs)
    ref = stats.ttest_1samp(diffs, 0.0)
    ci = ref.confidence_interval(0.95)
    assert r.df == 5 and r.p == pytest.approx(ref.pvalue) and (r.lo, r.hi) == pytest.approx((ci.low, ci.high))
    assert r.verdict == ("holds" if ci.low > 0 else "not resolved")
    # three seeds: the interval uses t(2), not 2 standard errors
    r3 = paired_t([1.0, 2.0, 3.0])
    assert (r3.hi - r3.mean) / r3.se == pytest.approx(4.302653, rel=1e-6)
    assert paired_t([-3.0, -2.0, -2.5]).verdict == "reversed"
    assert paired_t([-1.0, 1.0, 0.5]).verdict == "not resolved"
    assert "df 2" in r3.text()
    with pytest.raises(ValueError):
        paired_t([1.0])


def test_holm_adjusts_in_the_claims_order():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5]) == [0.5] and holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])


def test_equivalence_needs_the_interval_inside_the_margin():
    close = [0.1, -0.2, 0.15, 0.05, -0.1, 0.2, 0.0, -0.05]
    e = tost(close, margin=1.0)
    lower = stats.ttest_1samp(close, -1.0, alternative="greater").pvalue
    upper = stats.ttest_1samp(close, 1.0, alternative="less").pvalue
    assert e.p == pytest.approx(max(lower, upper)) and e.equivalent and -1 < e.lo < e.hi < 1
    # a small mean difference with three noisy seeds is not shown equal
    assert not tost([0.5, -1.5, 1.2], margin=1.0).equivalent
    assert not tost([2.0, 2.2, 1.9, 2.1], margin=1.0).equivalent


def test_detectable_effect_and_seeds():
    # n = 10, two-sided 5 %, 80 % power: d = 0.994 (the standard paired t power table)
    assert detectable_effect(1.0, 10) == pytest.approx(0.994, abs=0.005)
    # three seeds detect only large effects; more seeds, smaller ones
    assert detectable_effect(1.0, 3) > 2.5 * detectable_effect(1.0, 10)
    n = seeds_for(1.0, sd=1.0)
    assert n is not None and detectable_effect(1.0, n) <= 1.0 < detectable_effect(1.0, n - 1)
