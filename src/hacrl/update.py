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

from hacrl.algorithms import ADVANTAGES, POLICY_LOSSES, kl_k3, masked_mean
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


def _aligned(values: list[list[float]], resp_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of each response placed at the response positions of ``resp_mask``."""
    out = torch.zeros_like(resp_mask)
    L = resp_mask.shape[1]
    for i, v in enumerate(values):
        if len(v):
            out[i, L - len(v):] = torch.tensor(v, dtype=out.dtype)
    return out


def train_learner(agent: Agent, batch: pd.DataFrame, cfg: Config, seed: int, prev_state: Path,
                  out_state: Path, ref_model=None) -> dict:
    """Update ``agent.model`` in place on ``batch`` (its learner-input records); return metrics.

    Raises :class:`hacrl.trainer.NonFiniteLossError` on a NaN/inf loss; the caller then
    writes no checkpoint.
    """
    a, tc = cfg.algorithm, cfg.trainer
    t0 = time.time()
    rewards = torch.tensor(batch["reward"].to_numpy(), dtype=torch.float32)
    codes, _ = pd.factorize(batch["prompt_id"])
    adv = ADVANTAGES[a.advantage](rewards, torch.tensor(codes, dtype=torch.long), a.adv_eps)
    loss_fn = POLICY_LOSSES[a.loss]
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
    old, gen_gap = [], 0.0
    with torch.no_grad():
        for idx, ids, attn, resp, gen_lp in packed:
            lp = token_logprobs(model, ids, attn, cfg.rollout.temperature)
            gen_gap = max(gen_gap, float(((lp - gen_lp).abs() * resp).max()))
            old.append(lp if tc.recompute_old_logprobs else gen_lp)
        ref = []
        if ref_model is not None:
            ref = [token_logprobs(ref_model, ids, attn, cfg.rollout.temperature) for _, ids, attn, _, _ in packed]

    logs = []
    rng = random.Random(seed)
    order = list(range(len(packed)))
    for epoch in range(tc.epochs):
        if epoch > 0:
            rng.shuffle(order)
        for m in order:
            idx, ids, attn, resp, _ = packed[m]
            logp, ent = token_logprobs(model, ids, attn, cfg.rollout.temperature, with_entropy=True)
            loss, met = loss_fn(logp, old[m], adv[idx], resp, a.clip_low, a.clip_high)
            kl = kl_k3(logp, ref[m], resp) if ref else None
            if kl is not None:
                loss = loss + a.kl_coef * kl
            gn = opt.step(loss)
            logs.append({"loss": loss.item(), "grad_norm": gn, "entropy": masked_mean(ent.detach(), resp).item(),
                         "kl": kl.item() if kl is not None else 0.0, **met})
    opt.save_state(out_state)
    secs = time.time() - t0
    n_tok = int(sum(len(x) for x in batch["input_response_ids"]))

    def mean(k):
        return float(np.mean([x[k] for x in logs])) if logs else 0.0

    return {"samples": len(batch), "updates": len(logs), "total_updates": opt.state.updates,
            "loss": mean("loss"), "grad_norm": mean("grad_norm"), "entropy": mean("entropy"),
            "kl_to_init": mean("kl"), "clip_frac": mean("clip_frac"), "ratio_mean": mean("ratio_mean"),
            "first_ratio_mean": logs[0]["ratio_mean"] if logs else 1.0,
            "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
            "adv_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
            "gen_vs_train_logprob_maxdiff": gen_gap, "seconds": round(secs, 2),
            "tokens_per_s": round(n_tok * tc.epochs / max(secs, 1e-9), 1)}
