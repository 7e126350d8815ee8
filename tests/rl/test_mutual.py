"""The Mutual RL probes (PRP, SGT; XGRPO is in test_losses.py) against hand-computed values."""

import math

import pytest
import torch

from hacrl.errors import ConfigError
from hacrl.rl.algorithms import (ADVANTAGES, LOSSES, AdvantageInputs, GroupAdvantageOptions, LossInputs,
                                 PrpOptions, SgtOptions, sgt_choose, sgt_gate, sgt_rows)


def loss_inputs(logp, old, mask, adv, is_self, behavior=None, rewards=None, groups=None, verified=None, key=None):
    b = logp.shape[0]
    return LossInputs(logp=logp, old_logp=old, mask=mask, advantages=adv, is_self=is_self,
                      omega_src=torch.ones(b), behavior_logp=old if behavior is None else behavior,
                      behavior_logp_mean=old.mean(1), rewards=rewards, group_ids=groups, verified=verified,
                      choice_key=key)


# ----------------------------------------------------------------------------- PRP

def prp_case():
    """One own sample (2 tokens) and one peer sample (2 tokens, the second padded)."""
    logp = torch.log(torch.tensor([[0.6, 0.5], [0.5, 1.0]]))
    old = torch.log(torch.tensor([[0.5, 0.5], [0.25, 1.0]]))    # the learner's snapshot on both
    peer = torch.log(torch.tensor([[9.9, 9.9], [0.45, 1.0]]))   # the peer's THL-aligned trace (row 1 only)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp, old, peer, mask, torch.tensor([1.0, 1.0]), torch.tensor([True, False])


def test_prp_with_the_learner_snapshot_denominator_by_hand():
    logp, old, peer, mask, adv, is_self = prp_case()
    loss, m = LOSSES["prp"].fn(loss_inputs(logp, old, mask, adv, is_self, behavior=peer), PrpOptions())
    # own: ratios 1.2, 1.0 -> 1.1; peer: 0.5 / 0.25 = 2.0, A > 0 -> clipped to 1.28
    assert loss.item() == pytest.approx(-(1.1 + 1.28) / 2, rel=1e-6)
    assert m["peer_ratio_mean"] == pytest.approx(2.0) and m["peer_clip_frac"] == 1.0
    assert m["samples"]["ratio"][1].item() == pytest.approx(2.0, rel=1e-6)
    assert m["samples"]["active"].tolist() == [1.0, 0.0]  # a clipped token passes no gradient


def test_prp_with_the_thl_aligned_peer_denominator_by_hand():
    logp, old, peer, mask, adv, is_self = prp_case()
    opts = PrpOptions(peer_denominator="thl_aligned_peer")
    logp = logp.clone().requires_grad_(True)
    loss, m = LOSSES["prp"].fn(loss_inputs(logp, old, mask, adv, is_self, behavior=peer), opts)
    # own unchanged (its trace is its own old policy); peer: 0.5 / 0.45 = 1.111 inside the window
    r = 0.5 / 0.45
    assert loss.item() == pytest.approx(-(1.1 + r) / 2, rel=1e-6)
    assert m["samples"]["ratio"][1].item() == pytest.approx(r, rel=1e-6)
    loss.backward()
    # d/d logp of -(1/2) rho A with rho = exp(logp - denom): -(1/2) rho on the peer's one token
    assert logp.grad[1, 0].item() == pytest.approx(-r / 2, rel=1e-5)
    assert logp.grad[1, 1].item() == 0.0


def test_prp_options_are_checked():
    with pytest.raises(ConfigError, match="peer_denominator"):
        PrpOptions(peer_denominator="peer")


# ----------------------------------------------------------------------------- SGT

# prompt 0: own 0/2 right, peer b right (verified) and peer c wrong       -> gate fires, b only
# prompt 1: own 1/2 right, peer right                                       -> no
# prompt 2: own 0/2 right, peer has reward 1 but no verified verdict        -> no
# prompt 3: own 0/2 right, peer wrong                                       -> no
# prompt 4: no own sample, peer right                                       -> no
ROWS = [  # (group, is_self, reward, verified)
    (0, True, 0.0, False), (0, True, 0.0, False), (0, False, 1.0, True), (0, False, 0.0, False),
    (1, True, 1.0, True), (1, True, 0.0, False), (1, False, 1.0, True),
    (2, True, 0.0, False), (2, True, 0.0, False), (2, False, 1.0, False),
    (3, True, 0.0, False), (3, True, 0.0, False), (3, False, 0.0, False),
    (4, False, 1.0, True),
]


def rows_tensors():
    g = torch.tensor([r[0] for r in ROWS])
    s = torch.tensor([r[1] for r in ROWS])
    rw = torch.tensor([r[2] for r in ROWS])
    v = torch.tensor([r[3] for r in ROWS])
    return g, s, rw, v


def test_sgt_gate_fires_only_for_an_all_wrong_learner_and_a_verified_peer_success():
    g, s, rw, v = rows_tensors()
    gate = sgt_gate(rw, g, s, v)
    assert torch.nonzero(gate).flatten().tolist() == [2]
    # a peer success that is verified but has no positive reward is not taken either
    assert not sgt_gate(torch.zeros_like(rw), g, s, v).any()
    # the filter the trainer applies before the layout: own rows plus the candidates
    inp = AdvantageInputs(rewards=rw, group_ids=g, is_self=s, source_ids=(~s).long(), learner=0,
                          omega=torch.ones(2, 2), producer_advantages=torch.zeros(len(ROWS)), verified=v)
    assert sgt_rows(inp, SgtOptions()).tolist() == (s | gate).tolist()


def test_sgt_chooses_up_to_k_per_prompt_by_key():
    cand = torch.tensor([False, True, True, True, True])
    g = torch.tensor([0, 0, 0, 0, 1])
    key = torch.tensor([0.0, 3.0, 1.0, 1.0, 5.0])
    assert sgt_choose(cand, g, key, 1).tolist() == [False, False, True, False, True]  # tie: earlier row
    assert sgt_choose(cand, g, key, 2).tolist() == [False, False, True, True, True]
    assert not sgt_choose(torch.zeros(5, dtype=torch.bool), g, key, 1).any()


def sgt_case():
    """Prompt 0: two own wrong samples, two peer successes (3 and 1 tokens); prompt 1: own 1/2."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.2, 0.4, 0.8],
                                   [0.1, 1.0, 1.0], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    is_self = torch.tensor([True, True, False, False, True, True])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    verified = rewards > 0
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.7, -0.7])
    return logp, mask, is_self, groups, rewards, verified, adv


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_sgt_nll_value_and_gradient_by_hand(norm):
    logp, mask, is_self, groups, rewards, verified, adv = sgt_case()
    logp = logp.clone().requires_grad_(True)
    lam = 0.5
    opts = SgtOptions(nll_weight=lam, length_norm=norm, choose="shortest")
    loss, m = LOSSES["sgt"].fn(loss_inputs(logp, logp.detach(), mask, adv, is_self, rewards=rewards,
                                           groups=groups, verified=verified), opts)
    # GRPO over the 4 own samples at ratio 1: (0 + 0 + 0.7 - 0.7) / 4 = 0; the shortest success
    # (row 3, one token of prob 0.1) is injected: NLL = -log 0.1 under either normalisation
    assert m["rescues"] == 1.0 and m["samples"]["rescued"].tolist() == [0, 0, 0, 1, 0, 0]
    assert loss.item() == pytest.approx(lam * -math.log(0.1), rel=1e-6)
    loss.backward()
    assert logp.grad[3, 0].item() == pytest.approx(-lam, rel=1e-6)
    assert logp.grad[2].abs().sum().item() == 0.0  # the other success is not injected
    assert logp.grad[3, 1:].abs().sum().item() == 0.0  # padding
    # own samples keep GRPO's gradient: -(1/4) A per token mean, i.e. -(1/4)(0.7)/3 per token
    assert logp.grad[4, 0].item() == pytest.approx(-0.7 / 4 / 3, rel=1e-5)


@pytest.mark.parametrize("norm,expected", [
    ("token", -(math.log(0.2) + math.log(0.4) + math.log(0.8) + math.log(0.1)) / 4),
    ("sequence", -(math.log(0.2) + math.log(0.4) + math.log(0.8) + math.log(0.1)) / 2)])
def test_sgt_length_normalisation_with_two_rescues(norm, expected):
    logp, mask, is_self, groups, rewards, verified, adv = sgt_case()
    opts = SgtOptions(nll_weight=1.0, length_norm=norm, max_rescues=2)
    loss, m = LOSSES["sgt"].fn(loss_inputs(logp, logp, mask, adv, is_self, rewards=rewards, groups=groups,
                                           verified=verified), opts)
    assert m["rescues"] == 2.0
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_sgt_choice_rules():
    logp, mask, is_self, groups, rewards, verified, adv = sgt_case()
    base = dict(rewards=rewards, groups=groups, verified=verified)

    def chosen(opts, key=None, old=None):
        _, m = LOSSES["sgt"].fn(loss_inputs(logp, logp if old is None else old, mask, adv, is_self, key=key,
                                            **base), opts)
        return torch.nonzero(m["samples"]["rescued"]).flatten().tolist()

    assert chosen(SgtOptions(choose="shortest")) == [3]
    # the highest mean log-prob under the learner's policy before the step (old_logp): row 2's
    # mean is log(0.4)-ish, row 3's log 0.1
    assert chosen(SgtOptions(choose="learner_logprob")) == [2]
    key = torch.tensor([0.0, 0.0, 0.9, 0.1, 0.0, 0.0])
    assert chosen(SgtOptions(choose="random"), key=key) == [3]
    assert chosen(SgtOptions(choose="random"), key=1 - key) == [2]
    with pytest.raises(ValueError, match="choice keys"):
        chosen(SgtOptions(choose="random"))


def test_sgt_without_a_rescue_is_grpo_on_the_own_samples():
    logp, mask, is_self, groups, rewards, verified, adv = sgt_case()
    none = torch.zeros_like(verified)  # nothing verified: the gate never fires
    new = logp + 0.05 * torch.arange(18.0).reshape(6, 3) / 18
    loss, m = LOSSES["sgt"].fn(loss_inputs(new, logp, mask, adv, is_self, rewards=rewards, groups=groups,
                                           verified=none), SgtOptions())
    own = is_self
    g, _ = LOSSES["grpo"].fn(loss_inputs(new[own], logp[own], mask[own], adv[own], is_self[own]),
                             SgtOptions())
    assert m["rescues"] == 0.0 and loss.item() == pytest.approx(g.item(), rel=1e-6)


def test_grpo_advantage_over_the_learners_own_rows():
    g, s, rw, v = rows_tensors()
    inp = AdvantageInputs(rewards=rw, group_ids=g, is_self=s, source_ids=(~s).long(), learner=0,
                          omega=torch.ones(2, 2), producer_advantages=torch.zeros(len(ROWS)), verified=v)
    own = ADVANTAGES["grpo"].fn(inp, GroupAdvantageOptions(group_rows="self"))
    pooled = ADVANTAGES["grpo"].fn(inp, GroupAdvantageOptions())
    assert own[~s].abs().sum() == 0  # peer rows carry no advantage
    assert own[:2].tolist() == [0.0, 0.0]  # an all-wrong own group stays at 0 (the peer success is not in it)
    assert pooled[0].item() < 0  # pooled, the peer's success would push the own samples down
    assert own[4].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-5)


def test_sgt_needs_whole_prompt_groups_in_a_minibatch():
    from hacrl.pipeline import params

    with pytest.raises(ConfigError, match="sgt loss works under prompt_groups"):
        params.from_dict(params.compose(["algorithm=sgt", "algorithm.minibatch_order=source_blocks"]))
