"""Capability statistics (docs/ALGORITHMS.md, "Capability"): per-agent accuracy per step, the windowed
capability ``P_hat`` over the last K steps (current included), the clamped ratio matrix
``omega[a][b] = P_hat[a] / P_hat[b]``, and pooled per-prompt statistics. The history is a
small JSON document that each iteration extends from the previous one.
"""

from __future__ import annotations

import pandas as pd

P_FLOOR = 1e-6  # the reference code floors P so a ratio never divides by zero


def step_accuracy(rewards: pd.DataFrame) -> float:
    r = rewards["reward"].dropna()
    return float((r > 0).mean()) if len(r) else 0.0


def windowed_capability(history: list[dict], agents: list[str], window: int) -> dict[str, float]:
    """Mean accuracy over the last ``window`` entries of ``history`` (each {agent: acc})."""
    out = {}
    for a in agents:
        vals = [h[a] for h in history if a in h][-window:]
        out[a] = max(P_FLOOR, sum(vals) / len(vals)) if vals else P_FLOOR
    return out


def omega_matrix(p_hat: dict[str, float], lo: float = 0.1, hi: float = 10.0,
                 warmup: bool = False) -> dict[str, dict[str, float]]:
    """``omega[a][b] = clamp(P_hat[a] / P_hat[b], lo, hi)``; all ones during warm-up."""
    return {a: {b: 1.0 if warmup else min(hi, max(lo, p_hat[a] / p_hat[b])) for b in p_hat}
            for a in p_hat}


def pooled_prompt_stats(rewards: pd.DataFrame) -> dict[str, float]:
    """Per-prompt pooled reward statistics over every agent's samples."""
    g = rewards.dropna(subset=["reward"]).groupby("prompt_id")["reward"]
    mean = g.mean()
    return {
        "prompts": int(len(mean)),
        "mean_reward": float(mean.mean()) if len(mean) else 0.0,
        "all_correct": float((mean == 1).mean()) if len(mean) else 0.0,
        "all_wrong": float((mean == 0).mean()) if len(mean) else 0.0,
        "mixed": float(((mean > 0) & (mean < 1)).mean()) if len(mean) else 0.0,
    }


def update_history(prev: dict, iteration: int, per_agent: dict[str, pd.DataFrame], window: int,
                   lo: float, hi: float, warmup_steps: int) -> dict:
    """The capability document for ``iteration`` from the previous one and this step's rewards."""
    steps = [s for s in prev.get("steps", []) if s["iteration"] < iteration]
    acc = {a: step_accuracy(df) for a, df in per_agent.items()}
    steps.append({"iteration": iteration, "accuracy": acc})
    agents = list(per_agent)
    p_hat = windowed_capability([s["accuracy"] for s in steps], agents, window)
    omega = omega_matrix(p_hat, lo, hi, warmup=len(steps) <= warmup_steps)
    pooled = pooled_prompt_stats(pd.concat(per_agent.values(), ignore_index=True))
    return {"iteration": iteration, "window": window, "steps": steps, "p_hat": p_hat,
            "omega": omega, "pooled": pooled}
