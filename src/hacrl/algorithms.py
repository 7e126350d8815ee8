"""Advantage estimators and policy losses: pure tensor functions registered by name.

No model, no I/O and no config object inside: each function takes tensors and numbers and
returns tensors (and a dict of scalar metrics), so it can be checked by hand on small inputs.
The formulas are those of ALGORITHMS.md §0. A new loss is a local change: write the
function, decorate it, name it in ``conf/algorithm/*.yaml``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ADVANTAGES: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}


@dataclass(frozen=True)
class AlgorithmSpec:
    """How an algorithm uses the pool: what a learner subscribes to in exchange-and-align."""

    name: str
    subscribe: str  # "self": a learner trains on its own records only; "all": on every agent's
    description: str


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec("grpo", "self", "independent GRPO (token-level clipped ratio)"),
    "gspo": AlgorithmSpec("gspo", "self", "independent GSPO (sequence-level length-normalised ratio)"),
}


def register_advantage(name: str):
    def deco(fn):
        ADVANTAGES[name] = fn
        return fn
    return deco


def register_policy_loss(name: str):
    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


@register_advantage("grpo")
def group_normalized_advantage(rewards: torch.Tensor, group_ids: torch.Tensor,
                               eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` (unbiased std).

    ``rewards`` (N,) float; ``group_ids`` (N,) long, one id per prompt. A group whose rewards
    are all equal gets advantage 0.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        m = group_ids == g
        r = rewards[m].float()
        std = r.std(unbiased=True) if r.numel() > 1 else torch.tensor(0.0)
        adv[m] = (r - r.mean()) / (std + eps)
    return adv


@register_policy_loss("grpo")
def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28):
    """GRPO: ``-(1/G) sum_i (1/|y_i|) sum_t min(rho A, clip(rho, 1-eps_l, 1+eps_h) A)``.

    ``logp``/``old_logp``/``mask``: (B, T) per-token log-probs and response mask;
    ``advantages``: (B,). Returns (loss, metrics).
    """
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    surr = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    per_seq = masked_mean(surr, mask, dim=1)
    loss = -per_seq.mean()
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
        metrics = {"clip_frac": masked_mean(clipped, mask).item(),
                   "ratio_mean": masked_mean(ratio, mask).item()}
    return loss, metrics


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(1/|y|) sum_t [log pi(y_t) - log pi_old(y_t)]`` per sequence: (B,)."""
    return masked_mean(logp - old_logp, mask, dim=1)


@register_policy_loss("gspo")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO: ``s_i = exp(mean_t log-ratio)``, loss ``-(1/G) sum_i min(s A, clip(s) A)``."""
    s = torch.exp(sequence_log_ratio(logp, old_logp, mask))
    surr = torch.minimum(s * advantages, s.clamp(1 - clip_low, 1 + clip_high) * advantages)
    loss = -surr.mean()
    with torch.no_grad():
        clipped = ((s < 1 - clip_low) | (s > 1 + clip_high)).float()
        metrics = {"clip_frac": clipped.mean().item(), "ratio_mean": s.mean().item()}
    return loss, metrics


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Low-variance KL estimator ``exp(r) - r - 1`` with ``r = ref - logp``, token mean per
    sequence, then mean over sequences."""
    r = ref_logp - logp
    return masked_mean(torch.exp(r) - r - 1, mask, dim=1).mean()
