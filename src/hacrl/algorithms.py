"""Advantage estimators and policy losses: pure tensor functions registered by name.

No model, no I/O and no config object inside: each function takes tensors and numbers and
returns tensors (and a dict of scalar metrics), so it can be checked by hand on small inputs.
The formulas are those of ALGORITHMS.md §0 (GRPO, GSPO) and §1 (HACPO). A new loss is a local
change: write the function, decorate it, name it in ``conf/algorithm/*.yaml``.

Two loss shapes exist: token-level (``grpo``, ``gspo``: per-token log-probs of one tokenizer)
and sample-level (``hacpo``: per-sample log-prob *means*, because a cross sample's numerator and
denominator are averaged over two different tokenizers' tokens). ``SAMPLE_LEVEL_LOSSES`` names
the latter.
"""

from __future__ import annotations

import math
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
    "gspo_x2": AlgorithmSpec("gspo_x2", "self", "independent GSPO with 2G samples per prompt (equal-cost baseline)"),
    "naive_share": AlgorithmSpec("naive_share", "all", "GSPO on every agent's rollouts, none of HACPO's mechanisms"),
    "hacpo": AlgorithmSpec("hacpo", "all", "HACPO: capability-aware advantage, discrepancy coefficient, "
                                           "exponential IS, stepwise clipping"),
}
SAMPLE_LEVEL_LOSSES = {"hacpo"}


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
                               eps: float = 1e-6, **_unused) -> torch.Tensor:
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


# ----------------------------------------------------------------------------- HACPO (§1)

def capability_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, source_ids: torch.Tensor,
                        learner: int, omega: torch.Tensor, use_capability: bool = True,
                        guards: bool = True) -> torch.Tensor:
    """HACPO's baseline ``mu^(k)`` per sample (§1.2): the mean over the prompt's pooled rewards,
    each source j's rewards weighted by ``omega[k, j]`` (learner over source, clamped).

    ``rewards``/``group_ids``/``source_ids``: (N,); ``learner``: k, an index into ``omega``
    (n, n). ``use_capability=False`` is the plain pooled mean (ablation ``-adv``). Guards of the
    reference code (``guards``): all rewards of the prompt equal -> their plain mean; a weighted
    mean above 1 -> the mean of the learner's own rewards of the prompt.
    """
    r = rewards.float()
    w = omega[learner, source_ids].float() if use_capability else torch.ones_like(r)
    _, inv = torch.unique(group_ids, return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0

    def gsum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32).index_add_(0, inv, x.float())

    cnt = gsum(torch.ones_like(r))
    b = gsum(w * r) / cnt
    if guards:
        plain = gsum(r) / cnt
        rmax = torch.full((n,), -math.inf).scatter_reduce(0, inv, r, "amax")
        rmin = torch.full((n,), math.inf).scatter_reduce(0, inv, r, "amin")
        own = (source_ids == learner).float()
        own_cnt = gsum(own)
        own_mean = torch.where(own_cnt > 0, gsum(own * r) / own_cnt.clamp(min=1), plain)
        b = torch.where(b > 1, own_mean, b)
        b = torch.where(rmax == rmin, plain, b)
    return b[inv]


def group_std(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Unbiased standard deviation of each sample's group (0 for a group of one), per sample."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0
    x = x.float()
    cnt = torch.zeros(n).index_add_(0, inv, torch.ones_like(x))
    mean = torch.zeros(n).index_add_(0, inv, x) / cnt
    ss = torch.zeros(n).index_add_(0, inv, (x - mean[inv]) ** 2)
    return torch.where(cnt > 1, (ss / (cnt - 1).clamp(min=1)).sqrt(), torch.zeros(n))[inv]


@register_advantage("hacpo")
def capability_aware_advantage(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, *,
                               source_ids: torch.Tensor, learner: int, omega: torch.Tensor,
                               use_capability: bool = True, **_unused) -> torch.Tensor:
    """HACPO advantage of every pooled sample for learner k (§1.2):
    ``A = (R - mu^(k)) / (std(raw pooled rewards of the prompt, unbiased) + eps)``; cross samples
    use the learner's baseline too. See :func:`capability_baseline` for ``mu`` and the guards.
    """
    r = rewards.float()
    mu = capability_baseline(r, group_ids, source_ids, learner, omega, use_capability)
    return (r - mu) / (group_std(r, group_ids) + eps)


@dataclass(frozen=True)
class HacpoLossConfig:
    """The knobs of the HACPO loss; each mechanism can be switched off alone (ablations)."""

    clip_low: float = 3e-4
    """Self samples: GSPO clip ``[1 - clip_low, 1 + clip_high]``."""
    clip_high: float = 4e-4
    alpha: float = 1.0
    """Exponential IS ``s * sg[s]^alpha`` on cross samples; 0 is the ``-expIS`` ablation."""
    delta: float = 0.2
    """Cross clip lower bound ``1 - delta`` at the first mini-batch of a step."""
    delta_step: float = 0.025
    """Raise of the lower bound per mini-batch; 0 is the ``-stepwise`` ablation."""
    log_ratio_clamp: float = 10.0
    use_omega: bool = True
    """Multiply cross samples by ``omega[j, k]`` (source over learner); False: ``-omega``."""
    use_cross_clip: bool = True
    """Clip cross ratios to ``[lower_m, 1]``; False: ``-clip``."""
    sg_on: str = "clipped"
    """Stop-gradient factor of the exponential IS on the ``clipped`` (reference) or ``raw`` ratio."""
    aggregation: str = "pooled_mean"
    """``pooled_mean``: one mean over all samples (reference); ``split``: mean(self) + mean(cross)."""


def stepwise_lower_bound(minibatch_index: int, delta: float, delta_step: float) -> float:
    """``lower_m = min(1, 1 - delta + m * delta_step)`` (§1.5), m 0-based within the step."""
    return min(1.0, 1.0 - delta + minibatch_index * delta_step)


@register_policy_loss("hacpo")
def hacpo_loss(new_logp_mean: torch.Tensor, old_logp_mean: torch.Tensor, advantages: torch.Tensor,
               is_self: torch.Tensor, omega_src: torch.Tensor, minibatch_index: int,
               cfg: HacpoLossConfig = HacpoLossConfig()):
    """HACPO loss of one mini-batch of learner k (§1.3-1.6), sample level.

    ``new_logp_mean`` (B,): the learner's mean log-prob of each response over *its own*
    tokens (with grad); ``old_logp_mean`` (B,): for self samples the learner's old policy on
    the same tokens, for cross samples the source's generation log-probs averaged over the
    *source's* tokens; ``advantages`` (B,): from :func:`capability_aware_advantage`;
    ``is_self`` (B,) bool; ``omega_src`` (B,): ``omega[j, k]`` of each sample's source j
    (1 for self). Self: ``min(s A, clip(s, 1-eps_l, 1+eps_h) A)``; cross: ``c sg[c]^alpha
    omega A`` with ``c = clip(s, lower_m, 1)`` (zero gradient outside). Loss = -mean.
    Returns (loss, metrics).
    """
    log_s = (new_logp_mean - old_logp_mean).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    s = torch.exp(log_s)
    a = advantages.float()
    self_term = torch.minimum(s * a, s.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * a)
    lower = stepwise_lower_bound(minibatch_index, cfg.delta, cfg.delta_step)
    c = s.clamp(lower, 1.0) if cfg.use_cross_clip else s
    sg = (c if cfg.sg_on == "clipped" else s).detach()
    w = omega_src.float() if cfg.use_omega else torch.ones_like(a)
    cross_term = c * sg.pow(cfg.alpha) * w * a
    per = torch.where(is_self, self_term, cross_term)
    cross = ~is_self
    if cfg.aggregation == "split":
        loss = -(per[is_self].mean() if is_self.any() else per.sum() * 0) \
               - (per[cross].mean() if cross.any() else per.sum() * 0)
    else:
        loss = -per.mean()
    with torch.no_grad():
        sc = s[cross]
        ss = s[is_self]
        metrics = {
            "cross_share": float(cross.float().mean()),
            "cross_lower_bound": lower,
            "cross_ratio_mean": float(sc.mean()) if sc.numel() else float("nan"),
            "cross_ratio_min": float(sc.min()) if sc.numel() else float("nan"),
            "cross_ratio_max": float(sc.max()) if sc.numel() else float("nan"),
            "cross_clipped_below": float((sc < lower).float().mean()) if sc.numel() else 0.0,
            "cross_clipped_above": float((sc > 1.0).float().mean()) if sc.numel() else 0.0,
            "ratio_mean": float(ss.mean()) if ss.numel() else float("nan"),
            "clip_frac": float(((ss < 1 - cfg.clip_low) | (ss > 1 + cfg.clip_high)).float().mean())
            if ss.numel() else 0.0,
        }
    return loss, metrics
