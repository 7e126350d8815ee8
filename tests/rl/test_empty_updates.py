"""An update whose gradient is exactly zero (every sample of its mini-batch clipped out of its
window) is counted, and ``trainer.skip_empty_updates`` skips its AdamW step: no momentum or weight
decay moves the weights, the lr warm-up does not advance. Off (the reference behaviour) it steps.
HACPO with a cross window of width 0 (``cross_clip_delta=0``, no stepwise widening) gives every
peer block an empty update here."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import fixed_rewards

from hacrl.exchange.experience import read_records
from hacrl.storage import read_json

CLOSED = ["algorithm=hacpo", "algorithm.loss.cross_clip_delta=0", "algorithm.loss.cross_clip_delta_step=0",
          "trainer.weight_decay=0.01"]


def _step(cfg, root, name, tag, **trainer):
    from hacrl.agents.pool import load_agent
    from hacrl.rl.step import train_learner

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))
    lay = cfg.layout
    agent = load_agent(cfg.agent(name), lay.checkpoint(0, name))
    stats = train_learner(agent, read_records(lay.learner_input(1, name), "learner_input"), cfg, seed=5,
                          prev_state=lay.train_state(0) / name, out_state=root / "st" / tag / name,
                          omega=read_json(lay.capability(1))["omega"])
    return stats, {k: v.detach().clone() for k, v in agent.model.state_dict().items()}


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_empty_updates_are_counted_and_skipped_on_request(workspaces, backend):
    cfg = workspaces.iteration("empty-updates", *CLOSED, rewards=fixed_rewards)
    root = workspaces.root / "empty-updates"
    name = cfg.agents[0].name
    off, w_off = _step(cfg, root, name, f"off-{backend}", backend=backend)
    on, w_on = _step(cfg, root, name, f"on-{backend}", backend=backend, skip_empty_updates=True)
    grad = off["per_update"]["grad_norm"]
    n_empty = sum(g == 0.0 for g in grad)
    assert 0 < n_empty < len(grad), grad  # the peers' blocks are empty, the own block is not
    assert off["empty_updates"] == n_empty and "skipped_updates" not in off
    assert on["empty_updates"] == on["skipped_updates"] == n_empty
    assert on["total_updates"] == off["total_updates"] - n_empty  # a skipped step is no update
    # the own block comes first (source_blocks): the same updates up to the first empty one, then
    # off takes bare AdamW steps (momentum, weight decay) that move the weights, on does not
    first_empty = grad.index(0.0)
    assert on["per_update"]["grad_norm"][:first_empty] == grad[:first_empty]
    assert max(float((w_on[k] - w_off[k]).abs().max()) for k in w_on) > 0
    assert on["per_update"]["update_to_weight"][first_empty] is None
    assert off["per_update"]["update_to_weight"][first_empty] > 0
