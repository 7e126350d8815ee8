"""The norm-matched control (``algorithm.norm_match``): each update's gradient from peers' samples
is replaced by a step of the same norm along the learner's own gradient. Checked on the tiny pool
through the figures the update reports of its gradients (before clipping):

- an update holding own and peer samples trains on ``(1 + c) g_own`` with ``c = ||g_cross|| /
  ||g_own||``: its gradient norm is ``||g_own|| + ||g_cross||`` (the two are parallel now);
- an update of peers' samples only (HACPO's reference layout) trains on ``c g_own(p)``: its
  gradient norm is exactly ``||g_cross||``.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import fixed_rewards

from hacrl.errors import ConfigError
from hacrl.exchange.experience import read_records
from hacrl.pipeline import params
from hacrl.rl.norm_match import partner
from hacrl.storage import read_json

from conftest import SMOKE


def _step(cfg, root, name, tag):
    from hacrl.agents.pool import load_agent
    from hacrl.rl.step import train_learner

    lay = cfg.layout
    agent = load_agent(cfg.agent(name), lay.checkpoint(0, name))
    return train_learner(agent, read_records(lay.learner_input(1, name), "learner_input"), cfg, seed=7,
                         prev_state=lay.train_state(0) / name, out_state=root / "st" / tag / name,
                         omega=read_json(lay.capability(1))["omega"])


def test_the_partner_of_a_peers_only_update_is_the_own_update_at_its_place():
    assert partner([32, 32, 0, 0], 2) == 0 and partner([32, 32, 0, 0], 3) == 1 and partner([32, 32, 0, 0], 1) == 1
    assert partner([16, 0, 0, 0], 3) == 0  # cyclically over the own ones
    assert partner([0, 0], 1) == 1  # no own samples at all: no direction (c is then 0)


@pytest.mark.parametrize("layout", ["prompt_groups", "source_blocks"])
def test_the_cross_gradient_is_replaced_by_a_step_of_its_norm_along_the_own_one(workspaces, layout):
    # unclipped cross ratios and a wide own window: the tiny pool's peers disagree too much for
    # HACPO's windows, and GSPO's own window closes after an update; both gradients must flow
    cfg = workspaces.iteration(f"normmatch-{layout}", "algorithm=hacpo", "algorithm.norm_match=true",
                               f"algorithm.minibatch_order={layout}", "algorithm.loss.cross_clip=false",
                               "algorithm.loss.clip_low=0.2", "algorithm.loss.clip_high=0.28", rewards=fixed_rewards)
    root = workspaces.root / f"normmatch-{layout}"
    name = cfg.agents[0].name
    st = _step(cfg, root, name, layout)
    per = st["per_update"]
    assert "norm_match_scale" in per and len(per["grad_norm"]) == st["updates"] >= 2
    mixed = peers_only = 0
    for g, gc, go in zip(per["grad_norm"], per["cross_grad_norm"], per["own_direction_norm"]):
        assert go > 0
        if layout == "prompt_groups" or gc == 0:  # own (and peer) samples: (1 + c) g_own
            assert g == pytest.approx(go + gc, rel=1e-5)
            mixed += gc > 0
        else:  # a peers' update of the reference layout: the step is exactly as long as the cross gradient
            assert g == pytest.approx(gc, rel=1e-5)
            peers_only += 1
    assert (mixed if layout == "prompt_groups" else peers_only) > 0
    # and HACPO itself, on the same rows and weights, takes the unmatched sum
    plain = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, norm_match=False))
    hacpo = _step(plain, root, name, f"{layout}-hacpo")
    first = hacpo["per_update"]["grad_norm"][0]
    if layout == "source_blocks":  # the own block's first update: no cross gradient, the same update
        assert first == pytest.approx(per["grad_norm"][0], rel=1e-6)
    else:  # ||g_own + g_cross|| <= ||g_own|| + ||g_cross||: sharing's step is at most the matched one
        assert first <= per["grad_norm"][0] * (1 + 1e-6)


def test_norm_match_needs_a_loss_that_drops_its_cross_terms_and_one_process():
    with pytest.raises(ConfigError, match=r"^algorithm.norm_match: invalid value True \(the grpo loss cannot drop"):
        params.from_dict(params.compose([*SMOKE, "algorithm=grpo", "algorithm.norm_match=true"]))
    with pytest.raises(ConfigError, match=r"^algorithm.norm_match: invalid value True \(the norms are of the whole"):
        params.from_dict(params.compose([*SMOKE, "algorithm=hacpo", "algorithm.norm_match=true",
                                         "trainer.world_size=2"]))
