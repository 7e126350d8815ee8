"""An update's figures add up exactly over the parts of its mini-batch (hacrl.rl.figures).

Each kind against the whole mini-batch's figure computed directly, on uneven parts; one part is
its own float bit for bit; a plain float from a loss is refused in one line.
"""

import math
import pickle

import pytest
import torch

from hacrl.rl import figures as fig

CUTS = [(0, 1), (1, 4), (4, 9), (9, 10)]  # uneven, one of a single row


def _parts(make):
    return [make(slice(a, b)) for a, b in CUTS]


@pytest.fixture
def rows():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(10, 7, generator=g)
    mask = (torch.rand(10, 7, generator=g) > 0.3).float()
    sel = torch.tensor([True, False, False, True, True, False, True, False, False, True])
    return x, mask, sel


def test_a_token_mean_is_the_mean_over_the_whole_mini_batch_tokens(rows):
    x, mask, _ = rows
    whole = float((x * mask).sum() / mask.sum())
    merged = fig.merge(_parts(lambda s: fig.mean(x[s], mask[s])))
    naive = sum(float(fig.mean(x[s], mask[s])) for s in (slice(a, b) for a, b in CUTS)) / len(CUTS)
    assert float(merged) == pytest.approx(whole, rel=1e-6)
    assert abs(naive - whole) > 1e-3  # the mean of the parts' means is another figure


def test_a_row_mean_over_selected_rows_and_an_empty_part(rows):
    x, _, sel = rows
    v = x[:, 0]
    whole = float(v[sel].mean())
    parts = _parts(lambda s: fig.mean(v[s], sel[s]))
    assert math.isnan(float(parts[2])) is False and float(fig.merge(parts)) == pytest.approx(whole, rel=1e-6)
    empty = fig.mean(v[1:3], sel[1:3])  # no selected row: nan, and weightless in a merge
    assert math.isnan(float(empty)) and float(fig.merge([empty, fig.mean(v[:1], sel[:1])])) == float(v[0])
    assert math.isnan(float(fig.merge([empty, empty])))


def test_counts_sum_shares_sum_and_ranks_average(rows):
    x, mask, sel = rows
    assert float(fig.merge(_parts(lambda s: fig.total(sel[s].sum())))) == float(sel.sum())
    # a share normalised by the whole mini-batch's count: the parts' shares add up to the whole
    n = float(mask.sum())
    shares = _parts(lambda s: fig.share((x[s] * mask[s]).sum() / n))
    assert float(fig.merge(shares)) == pytest.approx(float((x * mask).sum() / n), rel=1e-6)
    # two ranks, each share scaled by the world size (as DeepSpeed averages the gradients)
    ranks = [fig.share(2 * (x[:5] * mask[:5]).sum() / n), fig.share(2 * (x[5:] * mask[5:]).sum() / n)]
    assert float(fig.merge(ranks, ranks=2)) == pytest.approx(float((x * mask).sum() / n), rel=1e-6)


def test_a_share_that_no_part_holds_is_nan_and_one_that_some_part_holds_is_their_sum():
    absent, held = fig.share(0.0, present=False), fig.share(1.5, present=True)
    assert math.isnan(float(absent)) and math.isnan(float(fig.merge([absent, absent])))
    assert float(fig.merge([absent, held, absent])) == 1.5


def test_least_most_same_and_a_ratio_of_sums(rows):
    x, _, sel = rows
    v = x[:, 1]
    assert float(fig.merge(_parts(lambda s: fig.least(v[s][sel[s]])))) == float(v[sel].min())
    assert float(fig.merge(_parts(lambda s: fig.most(v[s][sel[s]])))) == float(v[sel].max())
    assert float(fig.merge([fig.same(0.8), fig.same(0.8)])) == 0.8
    share = fig.merge(_parts(lambda s: fig.ratio(v[s][sel[s]].sum(), v[s].sum(), empty=0.0)))
    assert float(share) == pytest.approx(float(v[sel].sum() / v.sum()), rel=1e-6)
    assert float(fig.ratio(torch.tensor(0.0), torch.tensor(0.0), empty=0.0)) == 0.0


def test_one_part_is_its_own_float_bit_for_bit_and_survives_pickling(rows):
    x, mask, _ = rows
    p = fig.mean(x, mask)
    direct = ((x * mask).sum() / mask.sum().clamp(min=1)).item()
    assert float(fig.merge([p])) == direct
    q = pickle.loads(pickle.dumps(p))  # gathered from the ranks
    assert (float(q), q.kind, q.num, q.den) == (float(p), p.kind, p.num, p.den)


def test_a_plain_float_or_mixed_kinds_are_refused_in_one_line():
    with pytest.raises(TypeError, match=r"^a figure was returned as a plain float .*Part"):
        fig.merge_all([{"clip_frac": 0.5}])
    with pytest.raises(ValueError, match="different kinds"):
        fig.merge([fig.total(1), fig.same(1)])
