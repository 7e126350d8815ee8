"""compute-capability-stats: step accuracy, windowed capability P_hat, omega, pooled prompt statistics."""

from __future__ import annotations

from hacrl.config.schema import Config
from hacrl.exchange.experience import read_records
from hacrl.pipeline.result import StageResult, numbers
from hacrl.rl.capability import update_history
from hacrl.storage import read_json, write_json


def compute_capability_stats(cfg: Config, t: int) -> StageResult:
    """Extend the capability history with step t: accuracy, windowed P_hat, omega, pooled stats."""
    lay = cfg.layout
    prev = read_json(lay.capability(t - 1))
    per_agent = {a.name: read_records(lay.rewards(t) / f"{a.name}.parquet", "verdict") for a in cfg.agents}
    c = cfg.algorithm.capability
    doc = update_history(prev, t, per_agent, c.window, c.omega_min, c.omega_max, c.warmup_steps)
    write_json(lay.capability(t), doc)
    return StageResult(doc, agents={a.name: {**numbers({"p_hat": doc.get("p_hat", {}).get(a.name)}),
                                             **numbers(doc.get("omega", {}).get(a.name, {}), "omega/")}
                                    for a in cfg.agents},
                       metrics=numbers(doc.get("pooled", {}), "pooled/"))
