"""GRPO / GSPO against hand-computed values."""

import math

import pytest
import torch

from hacrl.rl.algorithms import (ADVANTAGES, LOSSES, AdvantageInputs, ClipOptions, GroupAdvantageOptions,
                                 GspoOptions, LossInputs, kl_k3)


def run_loss(name, new, old, adv, mask, clip_low, clip_high):
    """A registered token/sequence loss on own samples only (the GRPO/GSPO situation)."""
    b = new.shape[0]
    inp = LossInputs(logp=new, old_logp=old, mask=mask, advantages=adv, is_self=torch.ones(b, dtype=torch.bool),
                     omega_src=torch.ones(b), behavior_logp=old, behavior_logp_mean=old.mean(1))
    opts = (ClipOptions if name == "grpo" else GspoOptions)(name, clip_low, clip_high)
    return LOSSES[name].fn(inp, opts)


def group_advantage(r, g, eps):
    n = len(r)
    inp = AdvantageInputs(rewards=r, group_ids=g, is_self=torch.ones(n, dtype=torch.bool),
                          source_ids=torch.zeros(n, dtype=torch.long), learner=0, omega=torch.ones(1, 1),
                          producer_advantages=torch.zeros(n))
    return ADVANTAGES["grpo"].fn(inp, GroupAdvantageOptions(eps=eps))


def test_group_advantage_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantage(r, g, 1e-6)
    std = math.sqrt(((1 - 1 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased
    assert adv[0].item() == pytest.approx((1 - 1 / 3) / (std + 1e-6), rel=1e-5)
    assert adv[1].item() == pytest.approx((0 - 1 / 3) / (std + 1e-6), rel=1e-5)
    assert torch.all(adv[3:] == 0)


def test_grpo_loss_by_hand():
    # two sequences; the second has one padded position
    old = torch.log(torch.tensor([[0.5, 0.5], [0.25, 1.0]]))
    new = torch.log(torch.tensor([[0.6, 0.5], [0.5, 1.0]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, m = run_loss("grpo", new, old, adv, mask, 0.2, 0.28)
    # seq 1: ratios 1.2 (inside [0.8, 1.28]) and 1.0 -> mean(1.2, 1.0) * 1 = 1.1
    # seq 2: ratio 2.0 with A<0: min(2*-2, 1.28*-2) = -4 -> mean over its 1 token = -4
    assert loss.item() == pytest.approx(-(1.1 + -4.0) / 2, rel=1e-6)
    assert m["clip_frac"] == pytest.approx(1 / 3)


def test_grpo_gradient_is_zero_outside_the_clip_on_the_advantage_side():
    old = torch.zeros(1, 1)
    new = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, _ = run_loss("grpo", new, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)
    loss.backward()
    assert new.grad.abs().item() == 0.0


def test_gspo_loss_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.2, 0.2]]))
    new = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2002, 0.2, 0.2]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.5, 1.0])
    loss, m = run_loss("gspo", new, old, adv, mask, 3e-4, 4e-4)
    s2 = math.exp(math.log(1.001) / 3)  # length-normalised: 1.000333 < 1 + 4e-4, not clipped
    assert loss.item() == pytest.approx(-(1.0 * 0.5 + s2 * 1.0) / 2, rel=1e-6)
    assert m["clip_frac"] == 0.0
    new2 = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.3, 0.2, 0.2]]))
    loss2, m2 = run_loss("gspo", new2, old, adv, mask, 3e-4, 4e-4)
    assert loss2.item() == pytest.approx(-(0.5 + 1.0004 * 1.0) / 2, rel=1e-6)
    assert m2["clip_frac"] == 0.5


def test_kl_k3_is_zero_at_the_reference_and_positive_elsewhere():
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    mask = torch.ones(1, 2)
    assert kl_k3(lp, lp, mask).item() == 0.0
    assert kl_k3(lp, lp + 0.1, mask).item() > 0


def xgrpo_inputs(r, pool_mean, pool_std):
    n = len(r)
    return AdvantageInputs(rewards=r, group_ids=torch.zeros(n, dtype=torch.long), is_self=torch.ones(n, dtype=torch.bool),
                           source_ids=torch.zeros(n, dtype=torch.long), learner=0, omega=torch.ones(1, 1),
                           producer_advantages=torch.zeros(n), pool_mean=torch.full((n,), pool_mean),
                           pool_std=torch.full((n,), pool_std))


def test_xgrpo_takes_the_baseline_from_the_pool():
    from hacrl.rl.algorithms import XgrpoAdvantageOptions

    # the learner's own 4 samples (1 success); the pool's mean on the prompt is 0.5, its std 0.4
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = ADVANTAGES["xgrpo"].fn(xgrpo_inputs(r, 0.5, 0.4), XgrpoAdvantageOptions())
    assert adv.tolist() == pytest.approx([0.5 / 0.4, -0.5 / 0.4, -0.5 / 0.4, -0.5 / 0.4], rel=1e-5)
    # scale=own: the learner's own group std (unbiased: 0.5 here)...
    adv = ADVANTAGES["xgrpo"].fn(xgrpo_inputs(r, 0.5, 0.4), XgrpoAdvantageOptions(scale="own"))
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, -1.0], rel=1e-5)
    # ...and the pool's when the own group has no spread: all-wrong learners still get a signal
    adv = ADVANTAGES["xgrpo"].fn(xgrpo_inputs(torch.zeros(4), 0.25, 0.5), XgrpoAdvantageOptions(scale="own"))
    assert adv.tolist() == pytest.approx([-0.5] * 4, rel=1e-5)
    # GRPO on the same own samples would give 0 there: the pooled baseline is what differs
    assert group_advantage(torch.zeros(4), torch.zeros(4, dtype=torch.long), 1e-6).abs().max() == 0
    with pytest.raises(ValueError, match="reward_stats"):
        ADVANTAGES["xgrpo"].fn(group_inputs_without_pool_stats(r), XgrpoAdvantageOptions())


def group_inputs_without_pool_stats(r):
    inp = xgrpo_inputs(r, 0.0, 0.0)
    inp.pool_mean = inp.pool_std = None
    return inp


def test_a_name_registers_once_and_options_are_typed():
    from dataclasses import dataclass

    from hacrl.errors import ConfigError
    from hacrl.rl.algorithms import LOSSES, build_options, register_advantage, register_loss

    with pytest.raises(ValueError, match="registered twice"):
        register_advantage("grpo", GroupAdvantageOptions)(lambda inp, opts: inp.rewards)
    with pytest.raises(ValueError, match="level"):
        register_loss("new-loss", ClipOptions, level="word")

    @dataclass(frozen=True)
    class NoName:
        eps: float = 0.0

    with pytest.raises(TypeError, match="name"):
        register_advantage("nameless", NoName)
    opts = build_options(LOSSES, {"name": "gspo", "clip_high": 1e-3}, "algorithm.loss")
    assert isinstance(opts, GspoOptions) and (opts.clip_low, opts.clip_high) == (3e-4, 1e-3)
    with pytest.raises(ConfigError, match=r"^algorithm.loss.clip_low: invalid value -1"):
        build_options(LOSSES, {"name": "gspo", "clip_low": -1}, "algorithm.loss")
