"""One learner's policy update on its training input (the body of update-policies).

Reads top to bottom like one RL step: advantages from the registry, mini-batches of whole
prompt groups, old log-probs, then per mini-batch: forward, registered loss (+ KL), clipped
step. The loss functions themselves live in :mod:`hacrl.algorithms`.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from hacrl.algorithms import ADVANTAGES, LOSSES, AdvantageInputs, LossInputs, kl_k3, masked_mean
from hacrl.config import Config
from hacrl.experience import pooled_reward_stats
from hacrl.pool import Agent
from hacrl.scoring import pack, token_logprobs
from hacrl.trainer import PolicyOptimizer

log = logging.getLogger(__name__)


def minibatches(prompt_ids: pd.Series, prompts_per_batch: int, seed: int) -> list[np.ndarray]:
    """Row indices of mini-batches made of whole prompt groups, prompt order shuffled by seed."""
    groups = list(dict.fromkeys(prompt_ids.tolist()))
    random.Random(seed).shuffle(groups)
    pos = {g: i // prompts_per_batch for i, g in enumerate(groups)}
    which = prompt_ids.map(pos).to_numpy()
    return [np.flatnonzero(which == b) for b in range(int(which.max()) + 1)] if len(which) else []


def self_first_minibatches(prompt_ids: pd.Series, is_self: pd.Series, n_batches: int, seed: int) -> list[np.ndarray]:
    """The reference trainer's order of a pooled batch (docs/ALGORITHMS.md, "Stepwise clipping"):
    the learner's own samples first, then the cross samples, each in a seeded prompt order, cut
    into ``n_batches`` contiguous mini-batches."""
    groups = list(dict.fromkeys(prompt_ids.tolist()))
    random.Random(seed).shuffle(groups)
    rank = prompt_ids.map({g: i for i, g in enumerate(groups)}).to_numpy()
    order = np.lexsort((np.arange(len(rank)), rank, ~is_self.to_numpy()))
    return [b for b in np.array_split(order, max(1, n_batches)) if len(b)]


def pool_tensors(cfg: Config, omega: dict | None) -> tuple[list[str], torch.Tensor]:
    """Agent names in pool order and the (n, n) omega matrix (ones when no capability is known)."""
    names = [ag.name for ag in cfg.agents]
    if omega is None:
        return names, torch.ones(len(names), len(names))
    return names, torch.tensor([[omega[i][j] for j in names] for i in names], dtype=torch.float32)


def advantage_inputs(batch: pd.DataFrame, cfg: Config, learner: str, omega: dict | None,
                     reward_stats: pd.DataFrame | None = None) -> AdvantageInputs:
    """What any estimator may read about the learner's training rows (see ``AdvantageInputs``)."""
    names, om = pool_tensors(cfg, omega)
    codes, _ = pd.factorize(batch["prompt_id"])
    inp = AdvantageInputs(
        rewards=torch.tensor(batch["reward"].to_numpy(), dtype=torch.float32),
        group_ids=torch.tensor(codes, dtype=torch.long),
        is_self=torch.tensor(batch["is_self"].to_numpy(), dtype=torch.bool),
        source_ids=torch.tensor(batch["producer"].map(names.index).to_numpy(), dtype=torch.long),
        learner=names.index(learner), omega=om,
        producer_advantages=torch.tensor(batch["advantage"].to_numpy(), dtype=torch.float32))
    if reward_stats is not None and len(reward_stats):
        pooled = pooled_reward_stats(reward_stats).set_index("prompt_id")
        missing = set(batch["prompt_id"]) - set(pooled.index)
        if missing:
            raise ValueError(f"learner {learner}: no reward statistics for prompt {sorted(missing)[0]!r}")
        inp.pool_mean = torch.tensor(batch["prompt_id"].map(pooled["mean"]).to_numpy(), dtype=torch.float32)
        inp.pool_std = torch.tensor(batch["prompt_id"].map(pooled["std"]).to_numpy(), dtype=torch.float32)
    return inp


def _aligned(values: list[list[float]], resp_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of each response placed at the response positions of ``resp_mask``."""
    out = torch.zeros_like(resp_mask)
    L = resp_mask.shape[1]
    for i, v in enumerate(values):
        if len(v):
            out[i, L - len(v):] = torch.tensor(v, dtype=out.dtype)
    return out


def _summary(logs: list[dict]) -> dict:
    """Per-update metrics of the loss -> one figure each (keys ending in _min / _max: the min /
    max over updates; others: the mean), over the updates where the metric is finite; a metric
    finite in no update is left out rather than reported as 0."""
    out = {}
    for k in dict.fromkeys(k for x in logs for k in x):
        vals = [x[k] for x in logs if k in x and np.isfinite(x[k])]
        if vals:
            out[k] = float(min(vals) if k.endswith("_min") else max(vals) if k.endswith("_max") else np.mean(vals))
    return out


def train_learner(agent: Agent, batch: pd.DataFrame, cfg: Config, seed: int, prev_state: Path,
                  out_state: Path, ref_model=None, omega: dict | None = None,
                  reward_stats: pd.DataFrame | None = None) -> dict:
    """Update ``agent.model`` in place on ``batch`` (its ``learner_input`` rows); return metrics.

    ``omega``: the step's capability ratios ``omega[a][b]``; ``reward_stats``: the reward
    statistics its subscription took, if any. The configured estimator and loss are looked up
    by name; nothing here depends on which algorithm runs. Every algorithm takes one optimizer
    step per ``trainer.mini_batch_prompts`` prompts.

    Raises :class:`hacrl.trainer.NonFiniteLossError` on a NaN/inf loss; the caller then
    writes no checkpoint.
    """
    a, tc = cfg.algorithm, cfg.trainer
    t0 = time.time()
    adv_inp = advantage_inputs(batch, cfg, agent.name, omega, reward_stats)
    adv = ADVANTAGES[a.advantage.name].fn(adv_inp, a.advantage)
    loss_fn = LOSSES[a.loss.name].fn
    is_self_all = adv_inp.is_self
    behavior_mean = torch.tensor(batch["behavior_logprob_mean"].to_numpy(), dtype=torch.float32)
    # omega[source][learner] of each sample: the discrepancy coefficient
    omega_src = adv_inp.omega[adv_inp.source_ids, adv_inp.learner]
    if a.minibatch_order == "self_first":
        n_prompts = batch["prompt_id"].nunique()
        mbs = self_first_minibatches(batch["prompt_id"], batch["is_self"],
                                     -(-n_prompts // tc.mini_batch_prompts), seed)
    else:
        mbs = minibatches(batch["prompt_id"], tc.mini_batch_prompts, seed)
    pad = agent.tokenizer.pad_token_id
    packed = []
    for idx in mbs:
        rows = batch.iloc[idx]
        ids, attn, resp = pack([list(x) for x in rows["input_prompt_ids"]],
                               [list(x) for x in rows["input_response_ids"]], pad)
        gen_lp = _aligned([list(x) for x in rows["old_logprobs"]], resp)
        behavior = _aligned([list(x) for x in rows["behavior_logprobs_aligned"]], resp)
        packed.append((idx, ids, attn, resp, gen_lp, behavior))

    samples_per_mb = max(len(i) for i in mbs) if mbs else 1
    opt = PolicyOptimizer(agent.model, tc, samples_per_mb)
    opt.load_state(prev_state)
    model = opt.model
    model.eval()  # no dropout in RL updates; gradients still flow

    # old log-probs: the trainer's own forward before any update (verl's "recompute"), so the
    # first mini-batch's ratio is exactly 1; the generation log-probs are compared against it
    # (peers' generation log-probs are in another tokenizer's tokens: the learner's recomputed
    # snapshot is their old policy)
    old, gen_gap = [], 0.0
    with torch.no_grad():
        for idx, ids, attn, resp, gen_lp, _ in packed:
            lp = token_logprobs(model, ids, attn, cfg.rollout.temperature)
            self_mask = resp * is_self_all[idx][:, None]
            gen_gap = max(gen_gap, float(((lp - gen_lp).abs() * self_mask).max()))
            old.append(lp if tc.recompute_old_logprobs else torch.where(self_mask.bool(), gen_lp, lp))
        ref = []
        if ref_model is not None:
            ref = [token_logprobs(ref_model, ids, attn, cfg.rollout.temperature) for _, ids, attn, *_ in packed]

    logs, loss_metrics = [], {}
    rng = random.Random(seed)
    order = list(range(len(packed)))
    update_index = 0  # m: the optimizer update's index within this step (all epochs)
    for epoch in range(tc.epochs):
        if epoch > 0 and a.minibatch_order != "self_first":
            rng.shuffle(order)
        for m in order:
            idx, ids, attn, resp, _, behavior = packed[m]
            logp, ent = token_logprobs(model, ids, attn, cfg.rollout.temperature, with_entropy=True)
            sf = is_self_all[idx]
            loss, met = loss_fn(LossInputs(logp=logp, old_logp=old[m], mask=resp, advantages=adv[idx],
                                           is_self=sf, omega_src=omega_src[idx], behavior_logp=behavior,
                                           behavior_logp_mean=behavior_mean[idx], update_index=update_index),
                                a.loss)
            update_index += 1
            loss_metrics.update(dict.fromkeys(met))
            kl = kl_k3(logp, ref[m], resp * sf[:, None]) if ref else None  # KL on self samples
            if kl is not None:
                loss = loss + a.kl_coef * kl
            gn = opt.step(loss)
            logs.append({"loss": loss.item(), "grad_norm": gn, "entropy": masked_mean(ent.detach(), resp).item(),
                         **({"kl": kl.item()} if kl is not None else {}), **met})
    opt.save_state(out_state)
    secs = time.time() - t0
    n_tok = int(sum(len(x) for x in batch["input_response_ids"]))
    summary = _summary(logs)
    if "kl" in summary:
        summary["kl_to_init"] = summary.pop("kl")
    rewards = adv_inp.rewards
    return {"samples": len(batch), "updates": len(logs), "total_updates": opt.state.updates, **summary,
            # the first update's ratio on the learner's own samples (1 by construction); absent
            # when that update holds none
            **({"first_ratio_mean": logs[0]["ratio_mean"]}
               if logs and np.isfinite(logs[0].get("ratio_mean", np.nan)) else {}),
            # the loss's own figures per update, in update order (null where not defined)
            "per_update": {k: [x[k] if k in x and np.isfinite(x[k]) else None for x in logs] for k in loss_metrics},
            "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
            "adv_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
            "cross_samples": int((~is_self_all).sum()),
            "gen_vs_train_logprob_maxdiff": gen_gap, "seconds": round(secs, 2),
            "tokens_per_s": round(n_tok * tc.epochs / max(secs, 1e-9), 1)}
