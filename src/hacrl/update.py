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

from hacrl.algorithms import (ADVANTAGES, POLICY_LOSSES, SAMPLE_LEVEL_LOSSES, HacpoLossConfig, kl_k3,
                              masked_mean)
from hacrl.config import Config
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
    """HACPO's reference order (§1.5): the learner's own samples first, then the cross samples,
    each in a seeded prompt order, cut into ``n_batches`` contiguous mini-batches."""
    groups = list(dict.fromkeys(prompt_ids.tolist()))
    random.Random(seed).shuffle(groups)
    rank = prompt_ids.map({g: i for i, g in enumerate(groups)}).to_numpy()
    order = np.lexsort((np.arange(len(rank)), rank, ~is_self.to_numpy()))
    return [b for b in np.array_split(order, max(1, n_batches)) if len(b)]


def learner_advantages(batch: pd.DataFrame, cfg: Config, learner: str, omega: dict | None) -> torch.Tensor:
    """Advantages of every sample of ``batch`` from the registered estimator (+ HACPO options)."""
    a = cfg.algorithm
    rewards = torch.tensor(batch["reward"].to_numpy(), dtype=torch.float32)
    codes, _ = pd.factorize(batch["prompt_id"])
    names = [ag.name for ag in cfg.agents]
    kw = {}
    if a.advantage == "hacpo":
        if omega is None:
            raise ValueError("the hacpo advantage needs the capability ratios (omega)")
        kw = {"source_ids": torch.tensor(batch["producer"].map(names.index).to_numpy(), dtype=torch.long),
              "learner": names.index(learner),
              "omega": torch.tensor([[omega[i][j] for j in names] for i in names], dtype=torch.float32),
              "use_capability": a.capability_advantage}
    adv = ADVANTAGES[a.advantage](rewards, torch.tensor(codes, dtype=torch.long), a.adv_eps, **kw)
    if a.cross_advantage == "source":  # §3 option: cross samples keep their producer's A^(j)
        cross = torch.tensor(~batch["is_self"].to_numpy())
        adv = torch.where(cross, torch.tensor(batch["advantage"].to_numpy(), dtype=torch.float32), adv)
    return adv


def _aligned(values: list[list[float]], resp_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of each response placed at the response positions of ``resp_mask``."""
    out = torch.zeros_like(resp_mask)
    L = resp_mask.shape[1]
    for i, v in enumerate(values):
        if len(v):
            out[i, L - len(v):] = torch.tensor(v, dtype=out.dtype)
    return out


def train_learner(agent: Agent, batch: pd.DataFrame, cfg: Config, seed: int, prev_state: Path,
                  out_state: Path, ref_model=None, omega: dict | None = None) -> dict:
    """Update ``agent.model`` in place on ``batch`` (its learner-input records); return metrics.

    ``omega``: the step's capability ratios ``omega[a][b]`` (HACPO). Every algorithm takes the
    same number of optimizer steps per epoch: one per ``trainer.mini_batch_prompts`` prompts.

    Raises :class:`hacrl.trainer.NonFiniteLossError` on a NaN/inf loss; the caller then
    writes no checkpoint.
    """
    a, tc = cfg.algorithm, cfg.trainer
    t0 = time.time()
    rewards = torch.tensor(batch["reward"].to_numpy(), dtype=torch.float32)
    adv = learner_advantages(batch, cfg, agent.name, omega)
    loss_fn = POLICY_LOSSES[a.loss]
    sample_level = a.loss in SAMPLE_LEVEL_LOSSES
    is_self_all = torch.tensor(batch["is_self"].to_numpy(), dtype=torch.bool)
    behavior = torch.tensor(batch["behavior_logprob_mean"].to_numpy(), dtype=torch.float32)
    omega_src = torch.ones(len(batch))
    if omega is not None:  # omega[source][learner]: the discrepancy coefficient of each sample
        omega_src = torch.tensor([omega[p][agent.name] for p in batch["producer"]], dtype=torch.float32)
    hcfg = HacpoLossConfig(a.clip_low, a.clip_high, a.alpha, a.cross_clip_delta, a.cross_clip_delta_step,
                           a.log_ratio_clamp, a.discrepancy_coef, a.cross_clip, a.sg_on, a.aggregation)
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
        packed.append((idx, ids, attn, resp, gen_lp))

    samples_per_mb = max(len(i) for i in mbs) if mbs else 1
    opt = PolicyOptimizer(agent.model, tc, samples_per_mb)
    opt.load_state(prev_state)
    model = opt.model
    model.eval()  # no dropout in RL updates; gradients still flow

    # old log-probs: the trainer's own forward before any update (verl's "recompute"), so the
    # first mini-batch's ratio is exactly 1; the generation log-probs are compared against it
    # (cross samples always use the learner's recomputed log-probs: their generation log-probs
    # are in another tokenizer's tokens)
    old, gen_gap = [], 0.0
    with torch.no_grad():
        for idx, ids, attn, resp, gen_lp in packed:
            lp = token_logprobs(model, ids, attn, cfg.rollout.temperature)
            self_mask = resp * is_self_all[idx][:, None]
            gen_gap = max(gen_gap, float(((lp - gen_lp).abs() * self_mask).max()))
            old.append(lp if tc.recompute_old_logprobs else torch.where(self_mask.bool(), gen_lp, lp))
        ref = []
        if ref_model is not None:
            ref = [token_logprobs(ref_model, ids, attn, cfg.rollout.temperature) for _, ids, attn, _, _ in packed]

    logs = []
    rng = random.Random(seed)
    order = list(range(len(packed)))
    step_index = 0  # HACPO's m: the mini-batch update's index within this step (all epochs)
    for epoch in range(tc.epochs):
        if epoch > 0 and a.minibatch_order != "self_first":
            rng.shuffle(order)
        for m in order:
            idx, ids, attn, resp, _ = packed[m]
            logp, ent = token_logprobs(model, ids, attn, cfg.rollout.temperature, with_entropy=True)
            sf = is_self_all[idx]
            if sample_level:
                new_mean = masked_mean(logp, resp, dim=1)
                old_mean = torch.where(sf, masked_mean(old[m], resp, dim=1), behavior[idx])
                loss, met = loss_fn(new_mean, old_mean, adv[idx], sf, omega_src[idx], step_index, hcfg)
            else:
                loss, met = loss_fn(logp, old[m], adv[idx], resp, a.clip_low, a.clip_high)
            step_index += 1
            kl = kl_k3(logp, ref[m], resp * sf[:, None]) if ref else None  # KL on self samples
            if kl is not None:
                loss = loss + a.kl_coef * kl
            gn = opt.step(loss)
            logs.append({"loss": loss.item(), "grad_norm": gn, "entropy": masked_mean(ent.detach(), resp).item(),
                         "kl": kl.item() if kl is not None else 0.0, **met})
    opt.save_state(out_state)
    secs = time.time() - t0
    n_tok = int(sum(len(x) for x in batch["input_response_ids"]))

    def mean(k):
        vals = [x[k] for x in logs if k in x and np.isfinite(x[k])]
        return float(np.mean(vals)) if vals else 0.0

    cross_stats = {}
    if sample_level:
        cross_stats = {k: mean(k) for k in ("cross_share", "cross_ratio_mean", "cross_clipped_below",
                                            "cross_clipped_above")}
        mins = [x["cross_ratio_min"] for x in logs if np.isfinite(x.get("cross_ratio_min", np.nan))]
        maxs = [x["cross_ratio_max"] for x in logs if np.isfinite(x.get("cross_ratio_max", np.nan))]
        cross_stats.update({"cross_ratio_min": float(min(mins)) if mins else 1.0,
                            "cross_ratio_max": float(max(maxs)) if maxs else 1.0,
                            "cross_lower_bounds": [x["cross_lower_bound"] for x in logs]})

    return {"samples": len(batch), "updates": len(logs), "total_updates": opt.state.updates,
            "loss": mean("loss"), "grad_norm": mean("grad_norm"), "entropy": mean("entropy"),
            "kl_to_init": mean("kl"), "clip_frac": mean("clip_frac"), "ratio_mean": mean("ratio_mean"),
            "first_ratio_mean": logs[0]["ratio_mean"] if logs else 1.0,
            "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
            "adv_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
            "cross_samples": int((~is_self_all).sum()), **cross_stats,
            "gen_vs_train_logprob_maxdiff": gen_gap, "seconds": round(secs, 2),
            "tokens_per_s": round(n_tok * tc.epochs / max(secs, 1e-9), 1)}
