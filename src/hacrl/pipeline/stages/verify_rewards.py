"""verify-rewards: every rollout checked against its gold answer by math-verify, in killable workers."""

from __future__ import annotations

import logging

import pandas as pd

from hacrl.config.schema import Config
from hacrl.exchange.experience import read_records, write_records
from hacrl.pipeline.stage_engines import verifier_lease
from hacrl.pipeline.result import StageResult, compact
from hacrl.pipeline.table import output_identity
from hacrl.storage import atomic_path
from hacrl.task.rewards import VERDICTS, VerifierPool, reward_of

log = logging.getLogger(__name__)


def verify_rewards(cfg: Config, t: int) -> StageResult:
    """math-verify every rollout against its gold answer in killable worker processes."""
    lay = cfg.layout
    stats = {}
    with atomic_path(lay.rewards(t), is_dir=True, identity=output_identity(cfg, lay.rewards(t), "verify-rewards", t)) as tmp, \
            VerifierPool.of(cfg.reward, lease=verifier_lease(cfg)) as pool:
        shards = {ac.name: read_records(lay.rollouts(t) / f"{ac.name}.parquet", "rollout") for ac in cfg.agents}
        # one call for the whole pool: no worker idles at the end of each agent's answers, and
        # an answer two agents both gave is checked once
        pairs = [p for ro in shards.values() for p in zip(ro["gold"], ro["response_text"])]
        every = pool.verify(pairs, desc="verify")
        start = 0
        for ac in cfg.agents:
            ro = shards[ac.name]
            verdicts, start = every[start:start + len(ro)], start + len(ro)
            df = pd.DataFrame({"record_id": ro["record_id"], "producer": ac.name,
                               "prompt_id": ro["prompt_id"], "verdict": verdicts,
                               "reward": [reward_of(v) for v in verdicts]})
            write_records(tmp / f"{ac.name}.parquet", df, "verdict")
            counts = df["verdict"].value_counts().to_dict()
            stats[ac.name] = {"reward_mean": float(df["reward"].mean()), "verdicts": counts}
            log.info("rewards %s: %s", ac.name, compact(stats[ac.name], ("reward_mean", "verdicts")))
            log.debug("rewards %s: %s", ac.name, stats[ac.name])
        stats["_killed_workers"] = pool.killed
        stats["_fast_verdicts"] = pool.fast
    per = {}
    for a in cfg.agents:
        counts = stats[a.name]["verdicts"]
        n = max(1, sum(counts.values()))
        per[a.name] = {"reward_mean": stats[a.name]["reward_mean"],  # every kind: 0 is a count here
                       **{f"verdict_{k}": counts.get(k, 0) / n for k in VERDICTS}}
    return StageResult(stats, agents=per, metrics={"killed_verifier_workers": pool.killed,
                                                   "fast_path_verdicts": pool.fast})
