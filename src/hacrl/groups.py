"""Group statistics: what a prompt's group of samples says about each sample.

Used both where experience is published (each producer's own group-normalised advantage,
``hacrl.exchange``) and where it is learned from (the advantage estimators and losses of
``hacrl.rl``), so it lives below both. Pure functions of tensors or of a frame of
``reward_stats`` records; torch and pandas are imported when first used.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hacrl.lazy import lazy_module

if TYPE_CHECKING:
    import pandas as pd
    import torch
else:  # config validation imports the algorithm registry, and with it this module, without torch
    torch = lazy_module("torch", globals())


def group_normalized_advantage(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` (unbiased std); a group whose
    rewards are all equal gets 0. ``rewards`` (N,) float, ``group_ids`` (N,) long."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        m = group_ids == g
        r = rewards[m].float()
        std = r.std(unbiased=True) if r.numel() > 1 else torch.tensor(0.0)
        adv[m] = (r - r.mean()) / (std + eps)
    return adv


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each sample's group as 0..n-1 (groups in sorted id order) and the number of groups n."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv, (int(inv.max()) + 1 if inv.numel() else 0)


def group_std(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Unbiased standard deviation of each sample's group (0 for a group of one), per sample."""
    inv, n = group_index(group_ids)
    x = x.float()
    cnt = torch.zeros(n).index_add_(0, inv, torch.ones_like(x))
    mean = torch.zeros(n).index_add_(0, inv, x) / cnt
    ss = torch.zeros(n).index_add_(0, inv, (x - mean[inv]) ** 2)
    return torch.where(cnt > 1, (ss / (cnt - 1).clamp(min=1)).sqrt(), torch.zeros(n))[inv]


def pooled_reward_stats(stats: pd.DataFrame) -> pd.DataFrame:
    """Combine ``reward_stats`` of several producers per prompt: n, mean and unbiased std of the
    pooled rewards (exact: from each producer's n, mean and std)."""
    if stats.empty:
        import pandas as pd

        return pd.DataFrame(columns=["prompt_id", "n", "mean", "std"])
    s = stats.assign(total=stats["n"] * stats["mean"],
                     sumsq=(stats["n"] - 1).clip(lower=0) * stats["std"] ** 2 + stats["n"] * stats["mean"] ** 2)
    g = s.groupby("prompt_id", sort=False)[["n", "total", "sumsq"]].sum().reset_index()
    g["mean"] = g["total"] / g["n"]
    var = (g["sumsq"] - g["n"] * g["mean"] ** 2) / (g["n"] - 1).clip(lower=1)
    g["std"] = [math.sqrt(max(v, 0.0)) if n > 1 else 0.0 for v, n in zip(var, g["n"])]
    return g[["prompt_id", "n", "mean", "std"]]
