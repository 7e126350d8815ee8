"""A learner's update across processes: DeepSpeed on the CPU accelerator, gloo, 2 ranks, ZeRO 1
and 2, against the single-process update on the same data (real processes, real DeepSpeed)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SMOKE, assert_same_figures
from safetensors.torch import load_file

from hacrl.exchange.experience import read_records
from hacrl.pipeline import params, table
from hacrl.rl.trainer import WORLD_FILE
from hacrl.storage import RunLayout

# fp32 sums in another order (each rank reduces half of a mini-batch) move the weights by a few
# ulps per update; Adam's normalisation can turn that into a larger step on a coordinate whose
# gradient is ~0, never more than a small fraction of the learning rate
WEIGHT_TOL = 1e-5


BASE = ["algorithm=hacpo", "trainer.mini_batch_prompts=4"]


def cfg_for(root, extra=()):
    data = params.compose(SMOKE + [*BASE, *extra])
    data["experiment"]["runs_dir"] = str(root / "runs")
    data["experiment"]["reports_dir"] = str(root / "reports")
    return params.from_dict(data)


def _spread(df):
    """Verdicts with spread inside each prompt group (the tiny pool barely solves anything after
    its short warm-up), so that the update moves the weights."""
    i = [a.name for a in cfg_for(Path(".")).agents].index(df["producer"].iloc[0])  # a shard is one agent's
    return [float((int(r.rsplit("/", 1)[1]) + j + i) % 3 == 0) for j, r in enumerate(df["record_id"])]


@pytest.fixture(scope="module")
def ready(workspaces):
    """Preparation + iteration 1 up to capability stats (HACPO: own and cross rows, 2 sources)."""
    workspaces.iteration("dp", *BASE, rewards=_spread)
    with workspaces.inside():
        yield workspaces.root / "dp"


_RUNS: dict = {}


def run_update(ready, extra):
    """Iteration 1's update-policies on a copy of the prepared runs (once per module per ``extra``)."""
    key = tuple(extra)
    if key not in _RUNS:
        root = ready / ("u" + str(len(_RUNS)))
        shutil.copytree(ready / "runs", root / "runs")
        cfg = cfg_for(root, extra)
        _RUNS[key] = (cfg, table.run("update-policies", cfg, 1))
    return _RUNS[key]


def weights(cfg, name, t=1):
    return load_file(RunLayout(cfg.experiment.runs_dir).checkpoint(t, name) / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_two_processes_give_the_single_process_weights(ready, zero):
    cfg1, s1 = run_update(ready, [])  # one process, ZeRO 0: the reference
    cfg2, s2 = run_update(ready, [f"trainer.zero_stage={zero}", "trainer.world_size=2"])
    for ac in cfg1.agents:
        w0, w1, w2 = weights(cfg1, ac.name, 0), weights(cfg1, ac.name), weights(cfg2, ac.name)
        assert w1.keys() == w2.keys()
        diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
        moved = max(float((w1[k] - w0[k]).abs().max()) for k in w1)
        logging.getLogger(__name__).info("%s ZeRO %d: moved %.3g, |ws2 - ws1| max %.3g", ac.name, zero, moved, diff)
        assert moved > 100 * WEIGHT_TOL, "the update must move the weights for the comparison to mean anything"
        assert diff <= WEIGHT_TOL, (ac.name, diff)
        # the figures rank 0 reports cover every rank's samples
        assert s2[ac.name]["world_size"] == 2 and s2[ac.name]["updates"] == s1[ac.name]["updates"]
        assert s2[ac.name]["samples"] == s1[ac.name]["samples"]
        assert s2[ac.name]["ratio/" + ac.name + "/n"] == s1[ac.name]["ratio/" + ac.name + "/n"]
        assert s2[ac.name]["loss"] == pytest.approx(s1[ac.name]["loss"], abs=1e-5)
        assert s2[ac.name]["grad_norm"] == pytest.approx(s1[ac.name]["grad_norm"], rel=1e-4)
        # the step's size, summed over the ranks' partitions of the master weights, is one process's
        assert s2[ac.name]["update_to_weight"] == pytest.approx(s1[ac.name]["update_to_weight"], rel=1e-3)
        # every figure is the whole mini-batch's (the ranks' parts merged, not their means
        # averaged), to the rounding of sums taken in another order
        assert_same_figures(s1[ac.name], s2[ac.name], f"{ac.name}, 2 ranks, ZeRO {zero}", tol=1e-4)
        # the export is a plain HF checkpoint at either world size; the state says its world size
        st = RunLayout(cfg2.experiment.runs_dir).train_state(1) / ac.name
        assert json.loads((st / WORLD_FILE).read_text()) == {"world_size": 2, "updates": s2[ac.name]["total_updates"],
                                                             "zero_stage": zero}


def _load_saved_state(saved_by, extra, caplog):
    """The first learner's optimizer at world size 1 with ``extra`` loading the state
    iteration 1's update wrote under ``saved_by``'s runs; returns (agent config, optimizer)."""
    from hacrl.agents.pool import load_agent
    from hacrl.rl.trainer import PolicyOptimizer

    cfg = params.from_dict({**params.compose(SMOKE + ["algorithm=hacpo", *extra]),
                            "experiment": {**saved_by.experiment.__dict__}})
    lay = RunLayout(cfg.experiment.runs_dir)
    ac = cfg.agents[0]
    opt = PolicyOptimizer(load_agent(ac, lay.checkpoint(1, ac.name)).model, cfg.trainer, 8)
    with caplog.at_level(logging.WARNING, logger="hacrl.rl.trainer"):
        opt.load_state(lay.train_state(1) / ac.name)
    return ac, opt


@pytest.mark.slow
def test_resuming_at_another_world_size_keeps_the_weights_and_says_what_restarts(ready, caplog):
    """A ZeRO 1 state saved by 2 ranks does not load in 1; the next update starts from the HF
    checkpoint, keeps the update counter, restarts Adam's moments, and says so."""
    cfg2, s2 = run_update(ready, ["trainer.zero_stage=1", "trainer.world_size=2"])
    ac, opt = _load_saved_state(cfg2, ["trainer.zero_stage=1"], caplog)
    assert opt.state.updates == s2[ac.name]["total_updates"] > 0
    assert "saved at world size 2 with ZeRO 1, this update runs at 1 with ZeRO 1" in caplog.text
    assert "restart from zero" in caplog.text
    assert not any(opt.optimizer.state.values())


@pytest.mark.slow
def test_a_failing_rank_fails_the_stage_and_leaves_no_checkpoint(ready, tmp_path):
    shutil.copytree(ready / "runs", tmp_path / "runs")
    cfg = cfg_for(tmp_path, ["trainer.world_size=2", "trainer.zero_stage=1"])
    lay = RunLayout(cfg.experiment.runs_dir)
    # a damaged learner input: every rank fails reading it
    (lay.learner_input(1, cfg.agents[0].name)).write_bytes(b"not parquet")
    from hacrl.pipeline.data_parallel import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"update of .*: rank \d of 2 exited with"):
        table.run("update-policies", cfg, 1)
    assert not lay.checkpoints(1).exists() and not lay.train_state(1).exists()


def test_ranks_take_whole_prompt_groups_and_too_small_a_mini_batch_is_refused():
    import numpy as np
    import pandas as pd

    from hacrl.rl.layout import rank_rows

    ids = pd.Series(["a", "a", "b", "b", "c"])
    assert rank_rows(ids, np.arange(5), 0, 2).tolist() == [0, 1, 4]
    assert rank_rows(ids, np.arange(5), 1, 2).tolist() == [2, 3]
    with pytest.raises(ValueError, match="fewer than trainer.world_size 4"):
        rank_rows(ids, np.arange(5), 0, 4)
    assert torch.equal(torch.tensor(rank_rows(ids, np.arange(5), 0, 1)), torch.arange(5))


SHARES = "resources.devices=[{id: 'cpu:0'}, {id: 'cpu:1'}]"


@pytest.mark.slow
def test_mwra_runs_two_learners_at_once_on_two_cpu_shares_with_the_same_result(ready, tmp_path):
    """The planner puts the two learners' updates in one wave (disjoint cpu shares); the stage
    runs them at once, each as its own process with one of the two cores. Placement changes
    where and when, not what: the weights equal the one-at-a-time update's."""
    from hacrl.resources import plan_for

    cfg1, s1 = run_update(ready, [])
    cfg, s = run_update(ready, [SHARES])
    waves = [[j.agent for j in w.jobs] for w in plan_for(cfg).waves if w.stage == "update"]
    together = [a.name for a in cfg.agents]
    assert waves == [together], waves
    for ac in cfg.agents:
        w1, w2 = weights(cfg1, ac.name), weights(cfg, ac.name)
        diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
        assert diff <= WEIGHT_TOL, (ac.name, diff)
        assert s[ac.name]["samples"] == s1[ac.name]["samples"]
        # a learner that shared its wave ran in its own process (the launcher's figures say so)
        assert ("world_size" in s[ac.name]) == (ac.name in together)
    # rollouts: the in-process transformers engine takes its jobs one at a time, so the same
    # seeds give the same tokens whatever the plan
    shutil.copytree(cfg1.experiment.runs_dir, tmp_path / "runs")
    c = cfg_for(tmp_path, [SHARES])
    table.run("generate-rollouts", c, 2)
    table.run("generate-rollouts", cfg1, 2)
    for ac in c.agents:
        a = read_records(RunLayout(c.experiment.runs_dir).rollouts(2) / f"{ac.name}.parquet", "rollout")
        b = read_records(RunLayout(cfg1.experiment.runs_dir).rollouts(2) / f"{ac.name}.parquet", "rollout")
        assert a["response_token_ids"].map(list).tolist() == b["response_token_ids"].map(list).tolist(), ac.name


@pytest.mark.slow
def test_resuming_with_zero_switched_on_restarts_adam_and_says_so(ready, caplog):
    """A ZeRO 0 state (one file per engine) does not load into a ZeRO 1 optimizer (partitioned
    files): the update keeps the counter, restarts Adam's moments and says so, not a missing file."""
    cfg0, s0 = run_update(ready, [])
    ac, opt = _load_saved_state(cfg0, ["trainer.zero_stage=1"], caplog)
    assert opt.state.updates == s0[ac.name]["total_updates"] > 0
    assert "with ZeRO 0, this update runs at 1 with ZeRO 1" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_micro_batches_across_two_processes_give_the_whole_mini_batch_update(ready, zero):
    """Each rank cuts its share of a mini-batch to the memory budget (the ranks may need a
    different number of micro-batches: the one with fewer runs a phantom one); the update equals
    the two-process update of whole mini-batches, and the gradients are reduced once per update."""
    dp = [f"trainer.zero_stage={zero}", "trainer.world_size=2"]
    cfg_w, s_w = run_update(ready, dp)
    cfg_m, s_m = run_update(ready, [*dp, "trainer.micro_batch_tokens=150"])
    for ac in cfg_w.agents:
        assert s_m[ac.name]["micro_batches"] > s_m[ac.name]["updates"] == s_w[ac.name]["updates"]
        w_w, w_m = weights(cfg_w, ac.name), weights(cfg_m, ac.name)
        diff = max(float((w_w[k] - w_m[k]).abs().max()) for k in w_w)
        assert diff <= 1e-6, (ac.name, zero, diff)
        assert s_m[ac.name]["loss"] == pytest.approx(s_w[ac.name]["loss"], abs=1e-6)
        assert s_m[ac.name]["grad_norm"] == pytest.approx(s_w[ac.name]["grad_norm"], rel=1e-6)
        assert_same_figures(s_w[ac.name], s_m[ac.name], f"{ac.name}, 2 ranks, ZeRO {zero}, cut")
