"""update-policies: one policy update per learner; new checkpoint and recovery state."""

from __future__ import annotations

import dataclasses
import logging

from hacrl.config.schema import Config
from hacrl.pipeline.learner_step import update_agent
from hacrl.pipeline.result import Input, Series, StageResult, compact, numbers, shard_inputs
from hacrl.pipeline.table import output_identity
from hacrl.pipeline.data_parallel import launch
from hacrl.resources import placement, plan_for, run_stage
from hacrl.rl.algorithms import LOSSES
from hacrl.runtime import set_threads
from hacrl.storage import atomic_path, without_timings, write_json

log = logging.getLogger(__name__)

UPDATE_LINE = ("samples", "updates", "loss", "grad_norm", "entropy", "update_to_weight", "clip_frac", "kl_to_init",
               "kl_init_before_step", "reward_mean", "cross_samples", "seconds")
"""What the terminal line of one learner's update shows (update_stats.json has everything)."""


def update_policies(cfg: Config, t: int) -> StageResult:
    """One policy update per learner on its training input; new HF checkpoint + recovery state.

    Learners run as the MWRA plan places them: one after another on a CPU host, at once where
    their devices do not overlap. An update runs in this process at world size 1 when it has the
    host to itself; otherwise as its own processes (:func:`hacrl.pipeline.data_parallel.launch`), as many
    as ``trainer.world_size`` on the CPU or its GPUs on a GPU host."""
    set_threads(cfg.experiment.threads)
    lay = cfg.layout
    rplan = plan_for(cfg)
    hooks = LOSSES[cfg.algorithm.loss.name].hooks  # the loss's own bookkeeping (SGT: its rescues)
    private = (*(hooks.private if hooks is not None else ()), "per_update")  # records, not figures
    together = {j.agent for w in rplan.waves if w.stage == "update" and len(w.jobs) > 1 for j in w.jobs}
    with atomic_path(lay.checkpoints(t), is_dir=True,
                     identity=output_identity(cfg, lay.checkpoints(t), "update-policies", t)) as tmp_ck, \
            atomic_path(lay.train_state(t), is_dir=True,
                        identity=output_identity(cfg, lay.train_state(t), "update-policies", t)) as tmp_st:
        def job(j) -> dict:
            name = j.agent
            where = placement(cfg.resources, j, cfg.experiment.threads)
            world = where.gpus or cfg.trainer.world_size
            if world > 1 or name in together or where.gpus:
                jcfg = dataclasses.replace(
                    cfg, trainer=dataclasses.replace(cfg.trainer, world_size=world),
                    experiment=dataclasses.replace(cfg.experiment, threads=where.threads))
                st = launch(jcfg, t, name, tmp_ck / name, tmp_st / name, env=where.env)
            else:
                st = update_agent(cfg, t, name, tmp_ck / name, tmp_st / name)
            if hooks is not None and hooks.carry is not None:  # state it keeps across iterations
                hooks.carry(lay.train_state(t - 1) / name, tmp_st / name, st, t)
            log.info("update %s: %s", name, compact(st, UPDATE_LINE))
            log.debug("update %s: %s", name, {k: v for k, v in st.items() if k not in private})
            return st

        done = run_stage(rplan, "update", job)
        stats = {a.name: done[a.name] for a in cfg.agents}
    write_json(lay.update_stats(t), without_timings(stats))
    names = [a.name for a in cfg.agents]
    keep = {n: {k: v for k, v in st.items() if k not in private} for n, st in stats.items()}
    return StageResult(
        stats, agents={n: numbers(keep[n], "train_") for n in names},
        # per-update figures at the learner's update count: 1 for its first update ever
        series={n: Series(int(st.get("total_updates", 0)) - int(st.get("updates", 0)) + 1,
                          {f"train_update_{k}": v for k, v in st.get("per_update", {}).items()})
                for n, st in stats.items()},
        inputs=(shard_inputs(lay.rollouts(t), names, "rollouts", t, "training")
                + shard_inputs(lay.rewards(t), names, "rewards", t, "training")
                + [Input(f"exchange/it{t}/learner-{n}", str(lay.learner_input(t, n)), "training") for n in names]),
        checkpoints={n: str(lay.checkpoint(t, n)) for n in names})
