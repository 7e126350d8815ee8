"""Advantage estimators and policy losses: pure tensor functions registered by name.

No model, no I/O inside: each registered function takes one inputs dataclass and its options
dataclass, and returns tensors (and a dict of scalar metrics), so it can be checked by hand on
small inputs. The formulas are written out in docs/ALGORITHMS.md.

The contract (one call shape each):

- an advantage estimator: ``fn(inp: AdvantageInputs, opts) -> advantages (N,)``;
- a policy loss: ``fn(inp: LossInputs, opts) -> (loss, metrics)``, registered with its level:
  ``token`` (per-token ratios on the learner's tokens) or ``sequence`` (one length-normalised
  ratio per sample). ``metrics`` maps names to floats; it may also hold ``samples``, a dict of
  (B,) tensors per sample (``ratio``, ``term``: the sample's surrogate, ``active``: 1 where the
  surrogate passes a gradient, ``clipped_below``, ``clipped_above``), from which the trainer
  reports ratio distributions per source and the share of the objective cross samples carry.

Each is registered with the dataclass of its options; a YAML section ``{name: ..., <options>}``
builds that dataclass field for field, so every knob has one name from YAML to the function.
An algorithm (``conf/algorithm/*.yaml``) names one estimator, one loss and its subscription.
Adding one is: write the function(s) here, decorate, write the YAML.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hacrl.config.build import build
from hacrl.config.schema import Settings, setting
from hacrl.errors import ConfigError
from hacrl.groups import group_index, group_normalized_advantage, group_std
from hacrl.lazy import lazy_module
from hacrl.rl import figures as fig
from hacrl.rl import rescues

if TYPE_CHECKING:
    import torch
else:  # config validation reads the registry only; the tensor functions import torch when first run
    torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class Registered:
    """One registered function with its options dataclass and, for a loss, its level."""

    name: str
    fn: Callable
    options: type
    level: str | None = None
    needs: tuple[str, ...] = ()
    """Record types the subscription must include (e.g. ``reward_stats``), checked at start-up."""
    rows: Callable | None = None
    """A loss's row filter ``rows(inp: AdvantageInputs, opts) -> (N,) bool``: the training rows
    that can take part in it; the trainer drops the others before the layout (e.g. SGT keeps a
    peer's success only where its gate can fire, so no forward pass is spent on the rest)."""
    layouts: tuple[str, ...] | None = None
    """The update layouts (``algorithm.minibatch_order``) a loss works under; None: any. A loss that
    reads whole prompt groups inside one mini-batch (SGT's gate) needs ``prompt_groups``."""
    split: str = "rows"
    """How a mini-batch may be cut into micro-batches (:mod:`hacrl.rl.micro`) for this loss:
    between any ``rows``, or between whole prompt ``groups`` only (a loss that reads a group)."""
    hooks: StepHooks | None = None
    """What the loss adds to a learner's step besides its loss (see :class:`StepHooks`)."""
    reads_peer_old: bool = True
    """Whether the loss reads the learner's pi_old on peers' rows. HACPO does not (a cross ratio's
    denominator is the producer's trace): the update then spends no forward pass on pi_old (or on
    the reference model) for a micro-batch of peers' rows only."""
    own_only: Callable | None = None
    """``own_only(opts) -> opts``: the options under which the loss keeps its own samples' terms
    and drops the peers' (their rows stay in the mean's count): what the norm-matched control
    (``algorithm.norm_match``) needs to tell the two gradients apart; None: it cannot."""


@dataclass(frozen=True)
class StepHooks:
    """A loss's own bookkeeping around a learner's step, so that the update, the update stage and
    the evaluation carry it out without naming the algorithm (SGT's rescues: :mod:`hacrl.rl.rescues`)."""

    figures: Callable[[list, Any], dict]
    """``figures(samples, batch)``: the step's extra figures from the per-sample outputs the loss
    returned in every update (``[(row indices, {name: (B,) tensor})]``) and the learner's batch."""
    carry: Callable[[Path | None, Path, dict, int], None] | None = None
    """``carry(prev_state_dir, state_dir, stats, t)``: state kept across iterations in the learner's
    train state (read from the previous iteration's, written into this one's); may add to ``stats``."""
    probes: Callable[[dict, int], dict[str, list[str]]] | None = None
    """``probes(stats, t)``: named sets of training prompt ids whose greedy accuracy the evaluation
    reports after the update (``NAME_accuracy``, ``NAME_n``)."""
    private: tuple[str, ...] = ()
    """Keys of the step's figures that are records, not figures: kept in ``update_stats.json``, not logged."""
    history: tuple[str, ...] = ()
    """Keys of the step's figures that the evaluation keeps in the run history."""


ADVANTAGES: dict[str, Registered] = {}
LOSSES: dict[str, Registered] = {}
LOSS_LEVELS = ("token", "sequence")


def _register(table: dict[str, Registered], name: str, options: type, level: str | None = None,
              needs: tuple[str, ...] = (), rows: Callable | None = None, layouts: tuple[str, ...] | None = None,
              hooks: StepHooks | None = None, split: str = "rows", own_only: Callable | None = None,
              reads_peer_old: bool = True):
    if split not in ("rows", "groups"):
        raise ValueError(f"{name}: split must be rows or groups")
    if not (dataclasses.is_dataclass(options) and "name" in {f.name for f in dataclasses.fields(options)}):
        raise TypeError(f"{name}: options must be a dataclass with a 'name' field")

    def deco(fn: Callable) -> Callable:
        if name in table:
            raise ValueError(f"{name!r} is registered twice ({table[name].fn.__qualname__} and {fn.__qualname__})")
        table[name] = Registered(name, fn, options, level, tuple(needs), rows, layouts, split, hooks, reads_peer_old,
                                 own_only)
        return fn
    return deco


def register_advantage(name: str, options: type, needs: tuple[str, ...] = ()):
    """Register ``fn(inp: AdvantageInputs, opts) -> (N,)`` under ``name`` with its options dataclass;
    ``needs``: record types its inputs come from besides the training rows."""
    return _register(ADVANTAGES, name, options, needs=needs)


def register_loss(name: str, options: type, level: str, rows: Callable | None = None,
                  layouts: tuple[str, ...] | None = None, hooks: StepHooks | None = None, split: str = "rows",
                  own_only: Callable | None = None, reads_peer_old: bool = True):
    """Register ``fn(inp: LossInputs, opts) -> (loss, metrics)``; ``level``: token or sequence;
    ``rows``, ``layouts``, ``split``, ``hooks``, ``own_only`` and ``reads_peer_old``: see
    :class:`Registered`."""
    if level not in LOSS_LEVELS:
        raise ValueError(f"loss {name!r}: level must be one of {LOSS_LEVELS}")
    return _register(LOSSES, name, options, level, rows=rows, layouts=layouts, hooks=hooks, split=split,
                     own_only=own_only, reads_peer_old=reads_peer_old)


def build_options(table: dict[str, Registered], section: Any, key: str):
    """The options dataclass of a YAML section ``{name: ..., <options>}``: typed and checked as
    every setting is (:func:`hacrl.config.build.build`), with one-line errors naming the key
    (unknown name, unknown option, wrong type, a value its rule refuses)."""
    if dataclasses.is_dataclass(section):
        return section
    if not isinstance(section, dict) or not isinstance(section.get("name"), str):
        raise ConfigError(f"{key}: invalid value {section!r} (a mapping with a 'name' and its options)")
    name = section["name"]
    if name not in table:
        raise ConfigError(f"{key}.name: invalid value {name!r} (choose from {', '.join(sorted(table))})")
    reg = table[name]
    fields = {f.name for f in dataclasses.fields(reg.options)}
    for k, v in section.items():
        if k not in fields:
            raise ConfigError(f"{key}.{k}: unknown option of {name} (value {v!r}; options: "
                              f"{', '.join(sorted(fields - {'name'}))})")
    return build(reg.options, section, key)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


@dataclass
class Shard:
    """Data parallelism: this rank holds whole prompt groups of the mini-batch, the other ranks
    the rest. A mean over the mini-batch's rows (or tokens) then divides by the count over all
    ranks, times the world size, because DeepSpeed averages the ranks' gradients: the sum of the
    ranks' gradients is the gradient of the single-process loss."""

    world_size: int = 1

    @property
    def split(self) -> bool:
        """Whether the mini-batch's rows are spread (over ranks, or micro-batches): means then divide
        by the counts :meth:`all_sum` returns, not by the local ones."""
        return self.world_size > 1

    def all_sum(self, v: float | torch.Tensor) -> float:
        """``v`` summed over the ranks (a collective: every rank must call it, in the same order)."""
        import torch.distributed as dist

        # NCCL (the GPU backend) reduces device tensors only; gloo reduces host ones
        dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([float(v)], dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        return float(t.item())


def row_mean(x: torch.Tensor, rows: torch.Tensor | None = None, shard: Shard | None = None) -> torch.Tensor:
    """Mean of ``x`` (B,) over ``rows`` (a bool mask; None: all), 0 with the graph kept when no
    row is selected. Split (over ranks or micro-batches, :attr:`Shard.split`): the mean over every
    part's rows, scaled for DeepSpeed's averaging over ranks; it always asks for the count. Whole:
    the plain expression, bit for bit."""
    if shard is None or not shard.split:
        if rows is None:
            return x.mean()
        return x[rows].mean() if bool(rows.any()) else x.sum() * 0
    sel = x if rows is None else x[rows]
    n = shard.all_sum(sel.numel())
    return sel.sum() * (shard.world_size / n) if n > 0 else x.sum() * 0


def sum_over_count(total: torch.Tensor, count: torch.Tensor, shard: Shard | None = None) -> torch.Tensor:
    """``total / max(1, count)``; split: over the count of every part, scaled as in :func:`row_mean`."""
    if shard is None or not shard.split:
        return total / count.clamp(min=1)
    return total * (shard.world_size / max(1.0, shard.all_sum(count)))


# ----------------------------------------------------------------------------- inputs

@dataclass
class AdvantageInputs:
    """Everything an estimator may use about one learner's N training samples."""

    rewards: torch.Tensor
    """(N,) float, the verified rewards."""
    group_ids: torch.Tensor
    """(N,) long, one id per prompt."""
    is_self: torch.Tensor
    """(N,) bool, the learner's own samples."""
    source_ids: torch.Tensor
    """(N,) long, the producing agent's index in the pool."""
    learner: int
    """The learner's index in the pool."""
    omega: torch.Tensor
    """(n, n) capability ratios omega[a, b] = P_hat[a] / P_hat[b], clamped (ones if unknown)."""
    producer_advantages: torch.Tensor
    """(N,) each record's published advantage: its producer's own group advantage."""
    pool_mean: torch.Tensor | None = None
    """(N,) mean reward of the sample's prompt over every subscribed producer (from
    ``reward_stats`` records); None when the subscription takes no reward statistics."""
    pool_std: torch.Tensor | None = None
    """(N,) the matching unbiased standard deviation."""
    verified: torch.Tensor | None = None
    """(N,) bool, the verifier's verdict was ``correct`` (None: not known)."""


@dataclass
class LossInputs:
    """One mini-batch of a learner: B samples, T response positions in the learner's tokens."""

    logp: torch.Tensor
    """(B, T) the learner's per-token log-probs now (with grad)."""
    old_logp: torch.Tensor
    """(B, T) the learner's policy before this step's first update, on the same tokens."""
    mask: torch.Tensor
    """(B, T) 1 on response tokens."""
    advantages: torch.Tensor
    """(B,)"""
    is_self: torch.Tensor
    """(B,) bool"""
    omega_src: torch.Tensor
    """(B,) omega[source, learner] of each sample (1 for the learner's own)."""
    behavior_logp: torch.Tensor
    """(B, T) the producer's generation log-probs on the learner's tokens: as generated for the
    learner's own samples, aligned by THL for peers' (per-word mass preserved)."""
    behavior_logp_mean: torch.Tensor
    """(B,) the producer's mean generation log-prob over its own tokens."""
    update_index: int = 0
    """m: the index of this optimizer update within the learner's step (0-based)."""
    rewards: torch.Tensor | None = None
    """(B,) the verified rewards (a loss that gates on outcomes reads them; None if not given)."""
    group_ids: torch.Tensor | None = None
    """(B,) long, one id per prompt."""
    verified: torch.Tensor | None = None
    """(B,) bool, the verdict was ``correct``."""
    choice_key: torch.Tensor | None = None
    """(B,) uniform [0, 1) per record, drawn from the update's seed and the record id (seeded choices)."""
    shard: Shard | None = None
    """Data parallelism across processes (None: one process). A loss takes its means over rows
    with :func:`row_mean` / :func:`sum_over_count`, and branches only on global counts."""


# ----------------------------------------------------------------------------- GRPO / GSPO

@dataclass(frozen=True)
class GroupAdvantageOptions(Settings):
    name: str = "grpo"
    eps: float = setting(1e-6, ge=0)
    """Added to the group's std."""
    group_rows: str = setting("all", choices=("all", "self"))
    """The rows whose rewards form a prompt's group statistics: ``all`` training rows of the prompt
    (for a sharing learner: own and peers' rewards pooled, as PRP and naive sharing do) or only the
    learner's ``self`` rows (SGT: its GRPO update unchanged by the injected peer successes, whose
    advantage is then 0)."""


@register_advantage("grpo", GroupAdvantageOptions)
def grpo_advantage(inp: AdvantageInputs, opts: GroupAdvantageOptions) -> torch.Tensor:
    """GRPO's group-relative advantage over every training sample of the prompt (``group_rows:
    self``: over the learner's own samples, 0 on the others)."""
    if opts.group_rows == "self":
        adv = torch.zeros_like(inp.rewards, dtype=torch.float32)
        own = inp.is_self
        if bool(own.any()):
            adv[own] = group_normalized_advantage(inp.rewards[own], inp.group_ids[own], opts.eps)
        return adv
    return group_normalized_advantage(inp.rewards, inp.group_ids, opts.eps)


@dataclass(frozen=True)
class ClipOptions(Settings):
    name: str = "grpo"
    clip_low: float = setting(0.2, ge=0)
    """eps_l: the ratio is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = setting(0.28, ge=0)
    """eps_h (0.28 as in DAPO's clip-higher)."""



@dataclass(frozen=True)
class GspoOptions(ClipOptions):
    name: str = "gspo"
    clip_low: float = setting(3e-4, ge=0)
    clip_high: float = setting(4e-4, ge=0)


def clipped_surrogate(ratio: torch.Tensor, a: torch.Tensor, opts: ClipOptions) -> torch.Tensor:
    """PPO's clipped surrogate ``min(rho A, clip(rho, 1 - eps_l, 1 + eps_h) A)``, elementwise: per
    token (GRPO, PRP, SGT) or per sequence (GSPO, HACPO's own samples)."""
    return torch.minimum(ratio * a, ratio.clamp(1 - opts.clip_low, 1 + opts.clip_high) * a)


def outside_clip(ratio: torch.Tensor, opts: ClipOptions) -> torch.Tensor:
    """1.0 where the ratio lies outside ``[1 - eps_l, 1 + eps_h]`` (the clip fraction's numerator)."""
    return ((ratio < 1 - opts.clip_low) | (ratio > 1 + opts.clip_high)).float()


def count(x, shard: Shard | None = None) -> int:
    """A count over the mini-batch: ``x`` here, or summed over its parts (micro-batches, ranks)
    when it is split (a loss's figures then weigh as its means do)."""
    v = int(x)
    return int(round(shard.all_sum(v))) if shard is not None and shard.split else v


@register_loss("grpo", ClipOptions, level="token")
def grpo_loss(inp: LossInputs, opts: ClipOptions):
    """``-(1/B) sum_i (1/|y_i|) sum_t min(rho A, clip(rho, 1-eps_l, 1+eps_h) A)``, rho per token."""
    ratio = torch.exp(inp.logp - inp.old_logp)
    surr = clipped_surrogate(ratio, inp.advantages[:, None], opts)
    per_seq = masked_mean(surr, inp.mask, dim=1)
    loss = -row_mean(per_seq, shard=inp.shard)
    with torch.no_grad():
        metrics = {"clip_frac": fig.mean(outside_clip(ratio, opts), inp.mask), "ratio_mean": fig.mean(ratio, inp.mask)}
    return loss, metrics


def clip_active(s: torch.Tensor, a: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """1 where ``min(s A, clip(s, low, high) A)`` passes a gradient to ``s``: not when the clipped
    branch is the minimum (A > 0 above ``high``, A < 0 below ``low``)."""
    return (~(((a > 0) & (s > high)) | ((a < 0) & (s < low)))).float()


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(1/|y|) sum_t [log pi(y_t) - log pi_old(y_t)]`` per sequence: (B,)."""
    return masked_mean(logp - old_logp, mask, dim=1)


@register_loss("gspo", GspoOptions, level="sequence")
def gspo_loss(inp: LossInputs, opts: GspoOptions):
    """``s_i = exp(mean_t log-ratio)``, loss ``-(1/B) sum_i min(s A, clip(s) A)``."""
    s = torch.exp(sequence_log_ratio(inp.logp, inp.old_logp, inp.mask))
    a = inp.advantages
    surr = clipped_surrogate(s, a, opts)
    loss = -row_mean(surr, shard=inp.shard)
    with torch.no_grad():
        metrics = {"clip_frac": fig.mean(outside_clip(s, opts)), "ratio_mean": fig.mean(s),
                   "samples": {"ratio": s.detach(), "term": surr.detach(),
                               "active": clip_active(s, a, 1 - opts.clip_low, 1 + opts.clip_high),
                               "clipped_below": (s < 1 - opts.clip_low).float(),
                               "clipped_above": (s > 1 + opts.clip_high).float()}}
    return loss, metrics


@dataclass(frozen=True)
class XgrpoAdvantageOptions(Settings):
    name: str = "xgrpo"
    eps: float = setting(1e-6, ge=0)
    scale: str = setting("pool", choices=("pool", "own"))
    """Divide by the ``pool``'s reward std on the prompt, or by the learner's ``own`` group std
    (the pool's when the own group has no spread: its rewards are then all equal)."""


@register_advantage("xgrpo", XgrpoAdvantageOptions, needs=("reward_stats",))
def xgrpo_advantage(inp: AdvantageInputs, opts: XgrpoAdvantageOptions) -> torch.Tensor:
    """XGRPO (value-level sharing): ``A = (r - mean_pool(q)) / (std + eps)`` on the learner's own
    samples; the baseline is the mean reward of every subscribed producer on the prompt (only
    these scalars cross agents, from ``reward_stats`` records)."""
    if inp.pool_mean is None or inp.pool_std is None:
        raise ValueError("the xgrpo advantage needs reward_stats records in the subscription")
    std = inp.pool_std
    if opts.scale == "own":
        own = group_std(inp.rewards, inp.group_ids)
        std = torch.where(own > 0, own, inp.pool_std)
    return (inp.rewards.float() - inp.pool_mean) / (std + opts.eps)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, shard: Shard | None = None,
          clamp: float | None = None) -> torch.Tensor:
    """Low-variance KL estimator ``exp(r) - r - 1`` with ``r = ref - logp``, token mean per
    sequence, then mean over the sequences the mask selects (a row without any masked token,
    e.g. a cross sample, neither counts nor dilutes the mean). ``clamp`` c (verl's
    ``low_var_kl``: 10): ``r`` clamped to ``[-2c, 2c]``, each token's value to ``[-c, c]``."""
    r = (ref_logp - logp) * mask  # positions outside the mask contribute 0, never exp(inf) * 0
    if clamp is not None:
        r = r.clamp(-2 * clamp, 2 * clamp)
    k = torch.exp(r) - r - 1
    if clamp is not None:
        k = k.clamp(-clamp, clamp)
    rows = mask.sum(1) > 0
    per_seq = masked_mean(k, mask, dim=1)
    return row_mean(per_seq, rows, shard)


# ----------------------------------------------------------------------------- HACPO

def capability_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, source_ids: torch.Tensor,
                        learner: int, omega: torch.Tensor, use_capability: bool = True,
                        guards: bool = True) -> torch.Tensor:
    """HACPO's baseline ``mu^(k)`` per sample: the mean over the prompt's pooled rewards, each
    source j's rewards weighted by ``1 / omega[j, k]``, the exact inverse of the discrepancy
    coefficient the loss gives j's samples (as the reference trainer does). It equals
    ``omega[k, j]`` only when the clamp bounds are reciprocal (omega_min = 1 / omega_max).

    ``use_capability=False`` is the plain pooled mean (ablation). Guards of the reference code:
    all rewards of the prompt equal -> their plain mean; a weighted mean above 1 -> the mean of
    the learner's own rewards of the prompt.
    """
    r = rewards.float()
    w = 1.0 / omega[source_ids, learner].float() if use_capability else torch.ones_like(r)
    inv, n = group_index(group_ids)

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


@dataclass(frozen=True)
class HacpoAdvantageOptions(Settings):
    name: str = "hacpo"
    eps: float = setting(1e-6, ge=0)
    capability_aware: bool = True
    """Weight each source's rewards in the baseline by learner-over-source capability;
    False: the plain pooled mean (the ``-adv`` ablation)."""
    cross_advantage: str = setting("learner", choices=("learner", "source"))
    """Open choice: cross samples take the ``learner``'s advantage A^(k) (reference) or keep the
    ``source``'s own group advantage A^(j) (as published with the record)."""



@register_advantage("hacpo", HacpoAdvantageOptions)
def hacpo_advantage(inp: AdvantageInputs, opts: HacpoAdvantageOptions) -> torch.Tensor:
    """``A = (R - mu^(k)) / (std(raw pooled rewards of the prompt, unbiased) + eps)`` for every
    pooled sample; see :func:`capability_baseline` for ``mu`` and its guards."""
    r = inp.rewards.float()
    mu = capability_baseline(r, inp.group_ids, inp.source_ids, inp.learner, inp.omega, opts.capability_aware)
    adv = (r - mu) / (group_std(r, inp.group_ids) + opts.eps)
    if opts.cross_advantage == "source":
        adv = torch.where(inp.is_self, adv, inp.producer_advantages.float())
    return adv


@dataclass(frozen=True)
class HacpoLossOptions(Settings):
    """The HACPO loss; each mechanism can be switched off alone (the paper's ablations)."""

    name: str = "hacpo"
    clip_low: float = setting(3e-4, ge=0)
    """Self samples: the GSPO clip ``[1 - clip_low, 1 + clip_high]``."""
    clip_high: float = setting(4e-4, ge=0)
    alpha: float = setting(1.0, ge=0)
    """Exponential importance sampling ``s * sg[s]^alpha`` on cross samples (paper: 1 or 3); 0 is
    the ``-expIS`` ablation."""
    cross_clip: bool = True
    """Clip cross ratios to ``[lower_m, 1]`` (zero gradient outside); False is ``-clip``."""
    cross_clip_delta: float = setting(0.2, ge=0, le=1)
    """The cross clip's lower bound is ``1 - delta`` at the step's first update..."""
    cross_clip_delta_step: float = setting(0.025, ge=0)
    """...raised by this much per update (stepwise clipping); 0 is ``-stepwise``."""
    log_ratio_clamp: float = setting(10.0, gt=0)
    """Clamp of the cross log-ratio."""
    cross_ratio_unit: str = setting("source_tokens", choices=("source_tokens", "learner_tokens"))
    """The cross ratio's denominator. ``source_tokens`` (reference): the producer's mean generation
    log-prob over its own tokens, against the learner's mean over its tokens, so the ratio also
    measures how differently the two tokenizers cut the text; ``learner_tokens``: the producer's
    trace aligned onto the learner's tokens by THL, both means over the learner's tokens, i.e.
    the per-learner-token likelihood ratio of the same text."""
    discrepancy_coef: bool = True
    """Multiply cross samples by ``omega[source, learner]``; False is ``-omega``."""
    sg_on: str = setting("clipped", choices=("clipped", "raw"))
    """Open choice: the stop-gradient factor of the exponential IS is the ``clipped`` (reference)
    or the ``raw`` ratio."""
    aggregation: str = setting("pooled_mean", choices=("pooled_mean", "split"))
    """Open choice: ``pooled_mean``, one mean over all samples of the mini-batch (reference), or
    ``split``, mean(self) + mean(cross)."""
    cross_weight: float = setting(1.0, ge=0, le=1)
    """Scales the cross samples' terms of the objective (1: HACPO). 0 is the control that removes
    learning from peers alone: the same mini-batches (cross samples still in them and in the
    mean's count), optimizer updates, lr schedule and pooled baseline, no gradient from a peer's
    sample."""


def stepwise_lower_bound(update_index: int, delta: float, delta_step: float) -> float:
    """``lower_m = min(1, 1 - delta + m * delta_step)``, m 0-based within the step."""
    return min(1.0, 1.0 - delta + update_index * delta_step)


@register_loss("hacpo", HacpoLossOptions, level="sequence", reads_peer_old=False,
               own_only=lambda opts: dataclasses.replace(opts, cross_weight=0.0))
def hacpo_loss(inp: LossInputs, opts: HacpoLossOptions):
    """HACPO loss of one mini-batch of learner k, one ratio per sample.

    ``log s = mean over the learner's tokens of its log-probs - old``, where old is, for a self
    sample, the learner's old policy on the same tokens (GSPO's ratio) and, for a cross sample,
    the producer's generation log-prob mean over *its own* tokens (``source_tokens``) or over the
    learner's tokens of its THL-aligned trace (``learner_tokens``). Self: ``min(s A, clip(s,
    1-eps_l, 1+eps_h) A)``; cross: ``c sg[c]^alpha omega A`` with ``c = clip(s, lower_m, 1)``.
    Loss = -mean (or -(mean self + mean cross)).
    """
    is_self = inp.is_self
    new_mean = masked_mean(inp.logp, inp.mask, dim=1)
    producer_mean = (inp.behavior_logp_mean if opts.cross_ratio_unit == "source_tokens"
                     else masked_mean(inp.behavior_logp, inp.mask, dim=1))
    old_mean = torch.where(is_self, masked_mean(inp.old_logp, inp.mask, dim=1), producer_mean)
    log_s = (new_mean - old_mean).clamp(-opts.log_ratio_clamp, opts.log_ratio_clamp)
    s = torch.exp(log_s)
    a = inp.advantages.float()
    self_term = clipped_surrogate(s, a, opts)
    lower = stepwise_lower_bound(inp.update_index, opts.cross_clip_delta, opts.cross_clip_delta_step)
    c = s.clamp(lower, 1.0) if opts.cross_clip else s
    sg = (c if opts.sg_on == "clipped" else s).detach()
    w = inp.omega_src.float() if opts.discrepancy_coef else torch.ones_like(a)
    cross_term = c * sg.pow(opts.alpha) * w * a
    if opts.cross_weight != 1.0:  # the control; at 1 the reference's terms, bit for bit
        cross_term = opts.cross_weight * cross_term
    per = torch.where(is_self, self_term, cross_term)
    cross = ~is_self
    if opts.aggregation == "split":
        loss = -row_mean(per, is_self, inp.shard) - row_mean(per, cross, inp.shard)
    else:
        loss = -row_mean(per, shard=inp.shard)
    with torch.no_grad():
        # each sample's term as the trainer weighs it (1 / the mini-batch's rows): ``split`` means
        # each side over its own rows, so a sample's term is scaled by rows / its side's rows
        term = per
        if opts.aggregation == "split":
            n, n_self, n_cross = (count(x, inp.shard) for x in (len(per), is_self.sum(), cross.sum()))
            term = per * torch.where(is_self, n / max(1, n_self), n / max(1, n_cross))
        metrics = {
            "cross_share": fig.mean(cross.float()),
            "cross_lower_bound": fig.same(lower),
            "cross_ratio_mean": fig.mean(s, cross),
            "cross_ratio_min": fig.least(s[cross]),
            "cross_ratio_max": fig.most(s[cross]),
            "cross_clipped_below": fig.mean((s < lower).float(), cross),
            "cross_clipped_above": fig.mean((s > 1.0).float(), cross),
            "ratio_mean": fig.mean(s, is_self),
            "clip_frac": fig.mean(outside_clip(s, opts), is_self),
            # the share of this update's |objective| that cross samples carry
            "cross_objective_share": fig.ratio(term[cross].abs().sum(), term.abs().sum(), empty=0.0),
            "samples": {"ratio": s.detach(), "term": term.detach(),
                        "active": torch.where(is_self, clip_active(s, a, 1 - opts.clip_low, 1 + opts.clip_high),
                                              ((s >= lower) & (s <= 1.0)).float() if opts.cross_clip
                                              else torch.ones_like(s)),
                        "clipped_below": torch.where(is_self, s < 1 - opts.clip_low, s < lower).float(),
                        "clipped_above": torch.where(is_self, s > 1 + opts.clip_high, s > 1.0).float()},
        }
    return loss, metrics


# ----------------------------------------------------------------------------- Mutual RL probes

@dataclass(frozen=True)
class PrpOptions(ClipOptions):
    """PRP (peer rollout pooling, data level): GRPO's token loss over the learner's own and the
    peers' retokenised rollouts alike."""

    name: str = "prp"
    peer_denominator: str = setting("learner_snapshot", choices=("learner_snapshot", "thl_aligned_peer"))
    """The ratio's denominator on a peer's tokens. ``learner_snapshot``: the learner's own old
    policy re-scoring the peer's tokens (ignores how the peer generated them; the first update's
    ratio is 1 as for its own samples); ``thl_aligned_peer``: the peer's recorded generation trace
    aligned onto the learner's tokens by THL (the ratio then measures how far the learner is from
    the policy that actually produced the text)."""
    log_ratio_clamp: float = setting(10.0, gt=0)
    """Clamp of the per-token log-ratio (a peer token the learner finds very unlikely would
    otherwise overflow)."""


def _token_clip_samples(log_ratio: torch.Tensor, a: torch.Tensor, mask: torch.Tensor, low: float,
                        high: float, per_seq: torch.Tensor) -> dict:
    """Per-sample figures of a token-level clipped loss: the sequence's geometric-mean ratio, its
    term, and the shares of its tokens that pass a gradient / lie below / above the window."""
    rho = torch.exp(log_ratio)
    active = clip_active(rho, a.expand_as(rho), low, high)
    return {"ratio": torch.exp(masked_mean(log_ratio, mask, dim=1)), "term": per_seq,
            "active": masked_mean(active, mask, dim=1),
            "clipped_below": masked_mean((rho < low).float(), mask, dim=1),
            "clipped_above": masked_mean((rho > high).float(), mask, dim=1)}


@register_loss("prp", PrpOptions, level="token")
def prp_loss(inp: LossInputs, opts: PrpOptions):
    """``-(1/B) sum_i (1/|y_i|) sum_t min(rho A, clip(rho, 1-eps_l, 1+eps_h) A)`` over own and peer
    samples, ``rho = pi / denominator`` per learner token; the denominator is the learner's old
    policy for its own samples, and for a peer's the learner's snapshot or the peer's THL-aligned
    trace (``peer_denominator``)."""
    denom = inp.old_logp
    if opts.peer_denominator == "thl_aligned_peer":
        denom = torch.where(inp.is_self[:, None], inp.old_logp, inp.behavior_logp)
    log_ratio = (inp.logp - denom).clamp(-opts.log_ratio_clamp, opts.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    a = inp.advantages[:, None].float()
    surr = clipped_surrogate(ratio, a, opts)
    per_seq = masked_mean(surr, inp.mask, dim=1)
    loss = -row_mean(per_seq, shard=inp.shard)
    with torch.no_grad():
        samples = _token_clip_samples(log_ratio, a, inp.mask, 1 - opts.clip_low, 1 + opts.clip_high, per_seq)
        own = inp.mask * inp.is_self[:, None]
        peer = inp.mask * (~inp.is_self)[:, None]
        clipped = outside_clip(ratio, opts)
        metrics = {"clip_frac": fig.mean(clipped, own), "ratio_mean": fig.mean(ratio, own),
                   "cross_share": fig.mean((~inp.is_self).float()),
                   "peer_clip_frac": fig.mean(clipped, peer), "peer_ratio_mean": fig.mean(ratio, peer),
                   "samples": samples}
    return loss, metrics


@dataclass(frozen=True)
class SgtOptions(ClipOptions):
    """SGT (success-gated transfer, outcome level): GRPO on the learner's own samples, unchanged,
    plus a likelihood term on a peer's verified success for each prompt the learner failed."""

    name: str = "sgt"
    nll_weight: float = setting(0.1, ge=0)
    """lambda: the weight of the negative log-likelihood term."""
    length_norm: str = setting("token", choices=("token", "sequence"))
    """``token``: the NLL averaged over all injected tokens of the mini-batch (every token weighs
    the same); ``sequence``: each injected response's summed NLL, averaged over the responses."""
    choose: str = setting("shortest", choices=("shortest", "random", "learner_logprob"))
    """Which of a prompt's peer successes is injected: the ``shortest`` in the learner's tokens,
    a ``random`` one (drawn from the update's seed), or the one of highest mean
    ``learner_logprob`` under the learner's policy before the step (the easiest to absorb)."""
    max_rescues: int = setting(1, ge=1)
    """k: at most this many peer successes injected per prompt."""


def sgt_gate(rewards: torch.Tensor, group_ids: torch.Tensor, is_self: torch.Tensor,
             verified: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the peer rows that may be injected. A prompt's gate fires when the learner has
    samples of it and none is a verified success, and some peer row of it is a verified success
    with a positive reward; the candidates are those peer rows. A wrong or unverified peer
    response is never a candidate."""
    inv, n = group_index(group_ids)
    own = is_self.bool()
    ok = verified.bool() & (rewards.float() > 0)
    own_any = torch.zeros(n, dtype=torch.bool).index_put_((inv[own],), torch.tensor(True), accumulate=False)
    own_ok = torch.zeros(n, dtype=torch.bool).index_put_((inv[own & ok],), torch.tensor(True), accumulate=False)
    fires = own_any & ~own_ok
    return ~own & ok & fires[inv]


def sgt_choose(candidates: torch.Tensor, group_ids: torch.Tensor, key: torch.Tensor, k: int) -> torch.Tensor:
    """(N,) bool: per prompt, the ``k`` candidates of smallest ``key`` (ties: the earlier row)."""
    chosen = torch.zeros_like(candidates, dtype=torch.bool)
    idx = torch.nonzero(candidates).flatten()
    if not len(idx):
        return chosen
    order = sorted(idx.tolist(), key=lambda i: (int(group_ids[i]), float(key[i]), i))
    taken: dict[int, int] = {}
    for i in order:
        g = int(group_ids[i])
        if taken.get(g, 0) < k:
            chosen[i] = True
            taken[g] = taken.get(g, 0) + 1
    return chosen


def sgt_rows(inp: AdvantageInputs, opts: SgtOptions) -> torch.Tensor:
    """The rows SGT trains on: the learner's own, and the peer successes its gate admits."""
    if inp.verified is None:
        raise ValueError("the sgt loss needs the verdicts of the training rows")
    return inp.is_self.bool() | sgt_gate(inp.rewards, inp.group_ids, inp.is_self, inp.verified)


@register_loss("sgt", SgtOptions, level="token", rows=sgt_rows, layouts=("prompt_groups",), split="groups",
               hooks=StepHooks(rescues.figures, rescues.carry, rescues.probes, private=rescues.PRIVATE,
                               history=rescues.HISTORY))
def sgt_loss(inp: LossInputs, opts: SgtOptions):
    """``-(1/B_own) sum_{own i} (1/|y_i|) sum_t min(rho A, clip(rho) A) + lambda NLL(rescues)``.

    The GRPO term is over the learner's own samples only (the peer rows carry no advantage). The
    rescues are chosen inside the mini-batch (it holds whole prompt groups): per prompt whose
    own samples are all wrong, up to ``max_rescues`` of the peers' verified successes
    (:func:`sgt_gate`, :func:`sgt_choose`). ``NLL = -mean log pi`` over their tokens
    (``length_norm: token``) or the mean over them of each one's summed ``-log pi`` (``sequence``).
    """
    if inp.rewards is None or inp.group_ids is None or inp.verified is None:
        raise ValueError("the sgt loss needs rewards, group ids and verdicts of the mini-batch")
    own = inp.is_self.bool()
    ratio = torch.exp(inp.logp - inp.old_logp)
    surr = clipped_surrogate(ratio, inp.advantages[:, None].float(), opts)
    per_seq = masked_mean(surr, inp.mask, dim=1)
    grpo = row_mean(per_seq, own, inp.shard)
    cand = sgt_gate(inp.rewards, inp.group_ids, own, inp.verified)
    if opts.choose == "shortest":
        key = inp.mask.sum(1).float()
    elif opts.choose == "random":
        if inp.choice_key is None:
            raise ValueError("sgt choose=random needs the rows' seeded choice keys")
        key = inp.choice_key.float()
    else:  # the highest mean log-prob under the learner's policy before the step
        key = -masked_mean(inp.old_logp, inp.mask, dim=1)
    chosen = sgt_choose(cand, inp.group_ids, key, opts.max_rescues)
    sharded = inp.shard is not None and inp.shard.split
    if sharded:  # every part takes the same branches: the counts must pair up
        tok_nll = -(inp.logp * inp.mask)[chosen]
        nll = (sum_over_count(tok_nll.sum(), inp.mask[chosen].sum(), inp.shard) if opts.length_norm == "token"
               else row_mean(tok_nll.sum(1), shard=inp.shard)) + per_seq.sum() * 0
    elif bool(chosen.any()):
        tok_nll = -(inp.logp * inp.mask)[chosen]
        nll = (sum_over_count(tok_nll.sum(), inp.mask[chosen].sum()) if opts.length_norm == "token"
               else tok_nll.sum(1).mean())
    else:
        nll = per_seq.sum() * 0
    loss = -grpo + opts.nll_weight * nll
    with torch.no_grad():
        own_tok = inp.mask * own[:, None]
        seq_nll = -masked_mean(inp.logp, inp.mask, dim=1)
        # each sample's share of the objective: own samples their GRPO term over B_own, a rescue
        # its NLL term (weighted as in the loss); the trainer weights terms by 1 / mini-batch
        # size. The counts are the mini-batch's (over micro-batches and ranks), as the loss's are.
        n_all, n_own, n_chosen = (count(x, inp.shard) for x in (len(own), own.sum(), chosen.sum()))
        term = torch.where(own, per_seq * n_all / max(1, n_own),
                           torch.where(chosen, -opts.nll_weight * seq_nll * n_all / max(1, n_chosen),
                                       torch.zeros_like(per_seq)))
        metrics = {"clip_frac": fig.mean(outside_clip(ratio, opts), own_tok), "ratio_mean": fig.mean(ratio, own_tok),
                   "rescues": fig.total(chosen.sum()),
                   "rescue_nll": fig.share(nll, present=bool(chosen.any())),
                   "samples": {"ratio": torch.exp(masked_mean(inp.logp - inp.old_logp, inp.mask, dim=1)),
                               "term": term, "active": (own | chosen).float(),
                               "rescued": chosen.float()}}
    return loss, metrics
