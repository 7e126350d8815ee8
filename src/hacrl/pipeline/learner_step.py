"""One learner's update of an iteration: the body update-policies runs, in its own process or in
each rank of a multi-process update (:mod:`hacrl.pipeline.data_parallel`)."""

from __future__ import annotations

from pathlib import Path

from hacrl.agents.pool import load_agent
from hacrl.config.schema import Config
from hacrl.exchange.experience import read_records
from hacrl.rl.trainer import world
from hacrl.rl.step import train_learner
from hacrl.seeds import hash_seed
from hacrl.storage import read_json


def update_agent(cfg: Config, t: int, name: str, ckpt_out: Path, state_out: Path) -> dict:
    """One learner's update of iteration ``t``: its new HF checkpoint into ``ckpt_out`` (rank 0
    writes it) and its recovery state into ``state_out``; returns the update's figures. Runs in
    the stage's process, or in each rank of a multi-process update (:mod:`hacrl.pipeline.data_parallel`).
    The learner's own trainer settings (``agents.<name>.trainer``) apply."""
    cfg = cfg.for_learner(name)
    lay = cfg.layout
    ac = cfg.agent(name)
    agent = load_agent(ac, lay.checkpoint(t - 1, name), cfg.trainer.dtype)
    ref = None
    if cfg.algorithm.kl_coef > 0 or cfg.trainer.measure_kl_to_init:
        ref = load_agent(ac, lay.checkpoint(0, name), cfg.trainer.dtype).model
    batch = read_records(lay.learner_input(t, name), "learner_input")
    side = lay.learner_input(t, name, "reward_stats")
    stats = train_learner(
        agent, batch, cfg, seed=hash_seed(cfg.experiment.seed, "update", t, name),
        prev_state=lay.train_state(t - 1) / name, out_state=state_out,
        ref_model=ref, omega=read_json(lay.capability(t))["omega"],
        reward_stats=read_records(side, "reward_stats") if side.exists() else None)
    if world()[0] == 0:
        # ZeRO 0-2 keep the whole weights on every rank: the export never depends on the world size
        agent.model.save_pretrained(ckpt_out)
        agent.tokenizer.save_pretrained(ckpt_out)
    return stats
