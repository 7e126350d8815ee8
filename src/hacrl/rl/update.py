"""One learner's policy update on its training input (the body of update-policies).

Reads top to bottom like one RL step: advantages from the registry, mini-batches of whole
prompt groups, old log-probs, then per mini-batch: forward, registered loss (+ KL), clipped
step. The loss functions themselves live in :mod:`hacrl.rl.algorithms`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from hacrl.agents.pool import Agent
from hacrl.agents.scoring import pack, response_span, token_logprobs
from hacrl.config.schema import Config
from hacrl.groups import pooled_reward_stats
from hacrl.rl.algorithms import ADVANTAGES, LOSSES, AdvantageInputs, LossInputs, Shard, kl_k3, masked_mean
from hacrl.rl.micro import Recorder, Replay
from hacrl.rl.micro import plan as plan_micro
from hacrl.rl.micro import totals as micro_totals
from hacrl.rl.trainer import PolicyOptimizer, seed_rng, world
from hacrl.rollout.table import engine_spec

log = logging.getLogger(__name__)


def minibatches(prompt_ids: pd.Series, prompts_per_batch: int, seed: int) -> list[np.ndarray]:
    """Row indices of mini-batches made of whole prompt groups, prompt order shuffled by seed."""
    groups = list(dict.fromkeys(prompt_ids.tolist()))
    random.Random(seed).shuffle(groups)
    pos = {g: i // prompts_per_batch for i, g in enumerate(groups)}
    which = prompt_ids.map(pos).to_numpy()
    return [np.flatnonzero(which == b) for b in range(int(which.max()) + 1)] if len(which) else []


def self_first_minibatches(prompt_ids: pd.Series, is_self: pd.Series, n_batches: int, seed: int) -> list[np.ndarray]:
    """Layout ``self_first`` (this project's earlier HACPO layout): the learner's own samples
    first, then the cross samples, each in a seeded prompt order, cut into ``n_batches``
    contiguous mini-batches, so a mini-batch may mix sources."""
    groups = list(dict.fromkeys(prompt_ids.tolist()))
    random.Random(seed).shuffle(groups)
    rank = prompt_ids.map({g: i for i, g in enumerate(groups)}).to_numpy()
    order = np.lexsort((np.arange(len(rank)), rank, ~is_self.to_numpy()))
    return [b for b in np.array_split(order, max(1, n_batches)) if len(b)]


def source_block_minibatches(prompt_ids: pd.Series, producers: pd.Series, sources: list[str],
                             prompts_per_batch: int, seed: int) -> list[np.ndarray]:
    """Layout ``source_blocks`` (the HACPO reference trainer, docs/ALGORITHMS.md "Update layout"):
    one block per source in the order of ``sources`` (the learner first), each block cut into
    mini-batches of ``prompts_per_batch`` whole prompt groups in the seeded prompt order that
    :func:`minibatches` gives; no mini-batch mixes sources. The learner's own block is cut exactly
    as an independent learner's batch would be."""
    prod = producers.to_numpy()
    out = []
    for src in sources:
        rows = np.flatnonzero(prod == src)
        if len(rows):
            out += [rows[b] for b in minibatches(prompt_ids.iloc[rows].reset_index(drop=True), prompts_per_batch, seed)]
    return out


def prompts_per_update(cfg: Config) -> int:
    """Prompt groups per mini-batch. ``prompt_groups`` and ``self_first``: ``mini_batch_prompts``;
    ``source_blocks``: as many samples per update as an independent learner with G samples per
    prompt takes (``mini_batch_prompts * group_size`` samples), so GSPO x2 (2G per prompt)
    takes half the prompts per update and twice the updates."""
    tc = cfg.trainer
    if cfg.algorithm.minibatch_order != "source_blocks":
        return tc.mini_batch_prompts
    return tc.mini_batch_prompts * cfg.rollout.group_size // cfg.samples_per_prompt


def layout(batch: pd.DataFrame, cfg: Config, learner: str, seed: int) -> list[np.ndarray]:
    """Row indices of the learner's mini-batches, in update order (see ``AlgorithmConfig.minibatch_order``)."""
    order = cfg.algorithm.minibatch_order
    if order == "self_first":
        n_prompts = batch["prompt_id"].nunique()
        return self_first_minibatches(batch["prompt_id"], batch["is_self"],
                                      -(-n_prompts // cfg.trainer.mini_batch_prompts), seed)
    if order == "source_blocks":
        sources = [learner] + [a.name for a in cfg.agents if a.name != learner]
        return source_block_minibatches(batch["prompt_id"], batch["producer"], sources, prompts_per_update(cfg), seed)
    return minibatches(batch["prompt_id"], cfg.trainer.mini_batch_prompts, seed)


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
        producer_advantages=torch.tensor(batch["advantage"].to_numpy(), dtype=torch.float32),
        verified=torch.tensor((batch["verdict"] == "correct").to_numpy(), dtype=torch.bool))
    if reward_stats is not None and len(reward_stats):
        pooled = pooled_reward_stats(reward_stats).set_index("prompt_id")
        missing = set(batch["prompt_id"]) - set(pooled.index)
        if missing:
            raise ValueError(f"learner {learner}: no reward statistics for prompt {sorted(missing)[0]!r}")
        inp.pool_mean = torch.tensor(batch["prompt_id"].map(pooled["mean"]).to_numpy(), dtype=torch.float32)
        inp.pool_std = torch.tensor(batch["prompt_id"].map(pooled["std"]).to_numpy(), dtype=torch.float32)
    return inp


@dataclass
class Micro:
    """One micro-batch: its rows (positions in the learner's batch) packed for a forward."""

    idx: np.ndarray
    ids: torch.Tensor
    attn: torch.Tensor
    resp: torch.Tensor
    gen_lp: torch.Tensor
    behavior: torch.Tensor
    span: int | None
    phantom: bool = False
    """A rank's stand-in micro-batch when it has fewer than another rank (its loss weighs 0)."""


def _micro(batch: pd.DataFrame, idx: np.ndarray, pad: int, response_only: bool) -> Micro:
    rows = batch.iloc[idx]
    ids, attn, resp = pack([list(x) for x in rows["input_prompt_ids"]], [list(x) for x in rows["input_response_ids"]],
                           pad)
    return Micro(idx, ids, attn, resp, _aligned([list(x) for x in rows["old_logprobs"]], resp),
                 _aligned([list(x) for x in rows["behavior_logprobs_aligned"]], resp),
                 response_span(resp) if response_only else None)


def _all_max(values: list[int]) -> list[int]:
    """Each position's maximum over the ranks (a collective)."""
    import torch.distributed as dist

    dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _mean_metrics(mets: list[dict]) -> dict:
    """A mini-batch's loss figures from its micro-batches' (the mean of the finite ones; the
    loss and gradient themselves are exact, these are the loss's own diagnostics)."""
    out = {}
    for k in dict.fromkeys(k for x in mets for k in x):
        vals = [x[k] for x in mets if k in x and isinstance(x[k], (int, float)) and np.isfinite(x[k])]
        out[k] = float(np.mean(vals)) if vals else float("nan")
    return out


def enable_checkpointing(model) -> None:
    """Activation checkpointing of every decoder layer (transformers', non-reentrant)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def train_mode(model, checkpointing: bool) -> None:
    """Evaluation mode (no dropout) for the update's forwards; with activation checkpointing the
    decoder layers alone are marked training, which is what makes transformers checkpoint them
    (their attention and dropout modules stay in evaluation mode)."""
    model.eval()
    if checkpointing:
        from transformers.modeling_layers import GradientCheckpointingLayer

        for mod in model.modules():
            if isinstance(mod, GradientCheckpointingLayer):
                mod.training = True


def _aligned(values: list[list[float]], resp_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of each response placed at the response positions of ``resp_mask``."""
    out = torch.zeros_like(resp_mask)
    L = resp_mask.shape[1]
    for i, v in enumerate(values):
        if len(v):
            out[i, L - len(v):] = torch.tensor(v, dtype=out.dtype)
    return out


def sample_figures(samples: list[tuple[np.ndarray, dict]], producers: np.ndarray, learner: str) -> dict:
    """Step-level figures from the per-sample values a loss returned (its ``samples`` entry),
    collected over every update: per source, the distribution of the sequence ratio (mean,
    quantiles, min / max, share clipped below / above when the loss reports those) as
    ``ratio/<source>/<figure>``; ``cross_objective_share``, the share of the summed |objective|
    (each sample's surrogate term over its mini-batch size) carried by cross samples, and
    ``cross_gradient_share``, the same over the samples whose term passes a gradient (a cross
    sample clipped out of the window adds a constant, and no gradient).
    """
    cols: dict[str, list] = {}
    src, weight = [], []
    for idx, vals in samples:
        src.append(producers[idx])
        weight.append(np.full(len(idx), 1.0 / max(1, len(idx))))
        for k, v in vals.items():
            cols.setdefault(k, []).append(v.numpy())
    src = np.concatenate(src)
    cat = {k: np.concatenate(v) for k, v in cols.items()}
    out: dict = {}
    if "ratio" in cat:
        for s in dict.fromkeys(src.tolist()):
            sel = src == s
            r = cat["ratio"][sel]
            q = np.quantile(r, [0.1, 0.5, 0.9])
            fig = {"mean": float(r.mean()), "q10": float(q[0]), "q50": float(q[1]), "q90": float(q[2]),
                   "min": float(r.min()), "max": float(r.max()), "n": int(sel.sum())}
            for k in ("clipped_below", "clipped_above"):
                if k in cat:
                    fig[k] = float(cat[k][sel].mean())
            out.update({f"ratio/{s}/{k}": v for k, v in fig.items()})
    if "term" in cat:
        w = np.abs(cat["term"]) * np.concatenate(weight)
        total = float(w.sum())
        out["cross_objective_share"] = float(w[src != learner].sum()) / total if total > 0 else 0.0
        if "active" in cat:
            w = w * cat["active"]
            total = float(w.sum())
            out["cross_gradient_share"] = float(w[src != learner].sum()) / total if total > 0 else 0.0
    return out


def kl_old_to_ref(packed: list, old: list[torch.Tensor], ref: list[torch.Tensor], is_self: torch.Tensor,
                  shard: Shard | None = None) -> float | None:
    """KL(pi_old || pi_ref) by k3 over the learner's own samples (drawn from pi_old), one value per
    sample then their mean (over every rank's samples when sharded); None without own samples."""
    per = []
    for (idx, _ids, _attn, resp, *_), o, r in zip(packed, old, ref):
        sm = resp * is_self[idx][:, None]
        rows = sm.sum(1) > 0
        if bool(rows.any()):
            d = r - o
            per.append(masked_mean(torch.exp(d) - d - 1, sm, dim=1)[rows])
    if shard is not None and shard.world_size > 1:
        vals = torch.cat(per) if per else torch.zeros(0)
        n = shard.all_sum(vals.numel())
        return shard.all_sum(float(vals.sum())) / n if n else None
    return float(torch.cat(per).mean()) if per else None


def rank_rows(prompt_ids: pd.Series, idx: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """The rows of mini-batch ``idx`` that rank ``rank`` trains on: whole prompt groups, the
    groups dealt round-robin in their order in the mini-batch (a prompt's own and peer rows
    stay together, so a loss that reads a group, SGT's gate, sees all of it)."""
    if world_size == 1:
        return idx
    groups = list(dict.fromkeys(prompt_ids.iloc[idx].tolist()))
    if len(groups) < world_size:
        raise ValueError(f"a mini-batch holds {len(groups)} prompt groups, fewer than trainer.world_size "
                         f"{world_size}: raise trainer.mini_batch_prompts or lower the world size")
    mine = set(groups[rank::world_size])
    return idx[prompt_ids.iloc[idx].isin(mine).to_numpy()]


def _gather(obj):
    """Every rank's ``obj``, in rank order (a collective)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
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
    by name; nothing here depends on which algorithm runs. The mini-batches follow
    ``algorithm.minibatch_order`` (:func:`layout`); m, the update index the loss sees, counts
    every update of the step.

    Raises :class:`hacrl.rl.trainer.NonFiniteLossError` on a NaN/inf loss; the caller then
    writes no checkpoint.
    """
    a, tc = cfg.algorithm, cfg.trainer
    t0 = time.time()
    adv_inp = advantage_inputs(batch, cfg, agent.name, omega, reward_stats)
    loss_reg = LOSSES[a.loss.name]
    offered = len(batch)
    if loss_reg.rows is not None:  # rows the loss can never use cost no forward pass
        keep = loss_reg.rows(adv_inp, a.loss).numpy()
        batch = batch[keep].reset_index(drop=True)
        adv_inp = advantage_inputs(batch, cfg, agent.name, omega, reward_stats)
    adv = ADVANTAGES[a.advantage.name].fn(adv_inp, a.advantage)
    loss_fn = loss_reg.fn
    # a seeded uniform key per record, for losses that choose among rows at random
    choice_key = torch.tensor([random.Random(f"{seed}/{rid}").random() for rid in batch["record_id"]],
                              dtype=torch.float32)
    is_self_all = adv_inp.is_self
    behavior_mean = torch.tensor(batch["behavior_logprob_mean"].to_numpy(), dtype=torch.float32)
    # omega[source][learner] of each sample: the discrepancy coefficient
    omega_src = adv_inp.omega[adv_inp.source_ids, adv_inp.learner]
    rank, world_size = world()
    shard = Shard(world_size) if world_size > 1 else None
    # data parallelism: every rank lays out the same mini-batches and keeps its prompt groups
    mbs = [rank_rows(batch["prompt_id"], idx, rank, world_size) for idx in layout(batch, cfg, agent.name, seed)]
    pad = agent.tokenizer.pad_token_id
    # each mini-batch cut into micro-batches within the memory budget (one when there is none)
    lengths = (batch["input_prompt_ids"].map(len) + batch["input_response_ids"].map(len)).to_numpy()
    group_codes = adv_inp.group_ids.numpy() if loss_reg.split == "groups" else None
    packed: list[list[Micro]] = []
    over = 0
    for idx in mbs:
        parts, o = plan_micro(lengths[idx], group_codes[idx] if group_codes is not None else None,
                              tc.micro_batch_tokens, tc.micro_batch_samples)
        over += o
        packed.append([_micro(batch, idx[part], pad, tc.response_logits_only) for part in parts])
    if over:
        log.warning("%s: %d %s longer than trainer.micro_batch_tokens=%d (or more rows than micro_batch_samples=%d): "
                    "each is a micro-batch of its own (nothing is truncated)", agent.name, over,
                    "prompt groups" if group_codes is not None else "rows", tc.micro_batch_tokens,
                    tc.micro_batch_samples)
    if shard is not None and any(len(mb) > 1 for mb in packed):
        # every rank takes as many micro-batches per update (ZeRO 2 reduces at each): a rank with
        # fewer runs a phantom one (its smallest again, weighted 0)
        need = [int(x) for x in _all_max([len(mb) for mb in packed])]
        phantoms = sum(n - len(mb) for mb, n in zip(packed, need))
        for mb, n in zip(packed, need):
            while len(mb) < n:
                mb.append(dataclasses.replace(min(mb, key=lambda x: x.ids.numel()), phantom=True))
        if phantoms:
            log.info("%s: rank %d runs %d phantom micro-batches (another rank needs more)", agent.name, rank, phantoms)
    split_mbs = any(len(mb) > 1 for mb in packed)

    samples_per_mb = max(len(i) for i in mbs) if mbs else 1
    if tc.gradient_checkpointing:
        enable_checkpointing(agent.model)
    opt = PolicyOptimizer(agent.model, tc, samples_per_mb)
    seed_rng(seed)  # a first step's saved RNG state is then reproducible; a resumed one is restored
    opt.load_state(prev_state)
    model = opt.model
    train_mode(model, tc.gradient_checkpointing)  # no dropout in RL updates; gradients still flow

    # old log-probs (pi_old): the policy before the step's first update. ``recompute_old_logprobs``
    # (verl's "recompute"): the trainer's own forward for every sample, so the first update's
    # ratio is exactly 1. The first mini-batch's pi_old is then its first training forward,
    # detached (the same bits as a no-grad pass, measured in tests/test_update_speed.py), so the
    # no-grad pass covers the other mini-batches only. Off: own samples of an engine whose
    # generation log-probs are the trainer's (transformers) keep them; rows that are not
    # (cross samples, in another tokenizer's tokens; vLLM's kernels) are still recomputed. Either
    # way the generation log-probs are compared with the trainer's where both exist. Every pass
    # runs one micro-batch at a time.
    exact_engine = engine_spec(cfg.rollout.engine).exact_logprobs
    old: list[list[torch.Tensor | None]] = [[None] * len(mb) for mb in packed]
    gen_gap = 0.0
    chunk = tc.logprob_chunk

    def pi_old(lp: torch.Tensor, mi: Micro) -> torch.Tensor:
        """A micro-batch's pi_old from the trainer's log-probs ``lp`` at the step's start; also
        records how far the generation log-probs are from them."""
        nonlocal gen_gap
        self_mask = mi.resp * is_self_all[mi.idx][:, None]
        if bool(self_mask.any()):
            gen_gap = max(gen_gap, float(((lp - mi.gen_lp).abs() * self_mask).max()))
        if tc.recompute_old_logprobs or not exact_engine:
            return lp
        return torch.where(self_mask.bool(), mi.gen_lp, lp)

    def needs_pass(m: int, mi: Micro) -> bool:
        if ref_model is not None or split_mbs:  # pi_old of every micro-batch is read before its forward
            return True
        if m == 0:  # its first training forward (before any step) is pi_old
            return False
        return tc.recompute_old_logprobs or not exact_engine or not bool(is_self_all[mi.idx].all())

    recomputed = 0
    with torch.no_grad():
        for m, mb in enumerate(packed):
            for k, mi in enumerate(mb):
                if needs_pass(m, mi):
                    old[m][k] = pi_old(token_logprobs(model, mi.ids, mi.attn, cfg.rollout.temperature,
                                                      span=mi.span, chunk=chunk), mi)
                    recomputed += 0 if mi.phantom else len(mi.idx)
                elif m > 0:  # own samples of an exact engine
                    old[m][k] = mi.gen_lp
        ref: list[list[torch.Tensor]] = []
        if ref_model is not None:
            ref = [[token_logprobs(ref_model, mi.ids, mi.attn, cfg.rollout.temperature, span=mi.span, chunk=chunk)
                    for mi in mb] for mb in packed]
        flat = [(mi.idx, mi.ids, mi.attn, mi.resp) for mb in packed for mi in mb if not mi.phantom]
        kl_before = kl_old_to_ref(flat, [o for mb, ob in zip(packed, old) for mi, o in zip(mb, ob) if not mi.phantom],
                                  [r for mb, rb in zip(packed, ref) for mi, r in zip(mb, rb) if not mi.phantom],
                                  is_self_all, shard) if ref else None

    def objective(m: int, k: int, logp: torch.Tensor, part: Shard | None) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """Micro-batch k of mini-batch m: the registered loss (+ KL) on log-probs ``logp``."""
        mi = packed[m][k]
        idx, sf = mi.idx, is_self_all[mi.idx]
        loss, met = loss_fn(LossInputs(logp=logp, old_logp=old[m][k], mask=mi.resp, advantages=adv[idx],
                                       is_self=sf, omega_src=omega_src[idx], behavior_logp=mi.behavior,
                                       behavior_logp_mean=behavior_mean[idx], update_index=update_index,
                                       rewards=adv_inp.rewards[idx], group_ids=adv_inp.group_ids[idx],
                                       verified=adv_inp.verified[idx], choice_key=choice_key[idx], shard=part),
                            a.loss)
        # KL on self samples only; an update without any (a cross block) has no KL term. A
        # micro-batch asks for the same counts whatever its rows: its KL term is always there
        # (0 without own rows), so recording and replay pair up
        if isinstance(part, (Recorder, Replay)):
            kl = kl_k3(logp, ref[m][k], mi.resp * sf[:, None], part) if ref and a.kl_coef > 0 else None
        else:
            any_self = bool(sf.any()) if part is None else (bool(ref) and a.kl_coef > 0 and part.all_sum(sf.sum()) > 0)
            kl = kl_k3(logp, ref[m][k], mi.resp * sf[:, None], part) if ref and a.kl_coef > 0 and any_self else None
        if kl is not None:
            loss = loss + a.kl_coef * kl
        return loss, met, kl

    logs, loss_metrics, samples = [], {}, []
    rng = random.Random(seed)
    order = list(range(len(packed)))
    update_index = 0  # m: the optimizer update's index within this step (all epochs)
    for epoch in range(tc.epochs):
        if epoch > 0 and a.minibatch_order == "prompt_groups":
            rng.shuffle(order)
        for m in order:
            mb = packed[m]
            if len(mb) == 1 and not mb[0].phantom:  # the whole mini-batch in one forward
                mi = mb[0]
                logp, ent = token_logprobs(model, mi.ids, mi.attn, cfg.rollout.temperature, with_entropy=True,
                                           span=mi.span, chunk=chunk)
                if old[m][0] is None:  # the first mini-batch, before any update: this forward is pi_old
                    old[m][0] = pi_old(logp.detach(), mi)
                loss, met, kl = objective(m, 0, logp, shard)
                parts = [(mi, met.pop("samples", None))]
                gn = opt.step(loss)
                sf = is_self_all[mi.idx]
                entropy = masked_mean(ent.detach(), mi.resp * sf[:, None]).item() if bool(sf.any()) else float("nan")
                loss_v, kl_v, mets = loss.item(), (kl.item() if kl is not None else None), [met]
            else:  # micro-batches: the mini-batch's counts first, then one forward + backward each
                recorders = []
                with torch.no_grad():
                    for k, mi in enumerate(mb):
                        rec = Recorder(world_size)
                        objective(m, k, old[m][k], rec)
                        recorders.append(rec.values)
                counts = micro_totals([r for r, mi in zip(recorders, mb) if not mi.phantom], shard)
                loss_v, kl_v, mets, parts, ent_sum, ent_n = 0.0, None, [], [], 0.0, 0.0
                for k, mi in enumerate(mb):
                    logp, ent = token_logprobs(model, mi.ids, mi.attn, cfg.rollout.temperature, with_entropy=True,
                                               span=mi.span, chunk=chunk)
                    loss, met, kl = objective(m, k, logp, Replay(world_size, totals=counts))
                    gn = opt.micro_step(loss * 0.0 if mi.phantom else loss, last=k == len(mb) - 1)
                    if mi.phantom:
                        continue
                    own_tok = mi.resp * is_self_all[mi.idx][:, None]
                    ent_sum += float((ent.detach() * own_tok).sum())
                    ent_n += float(own_tok.sum())
                    loss_v += loss.item()
                    kl_v = (kl_v or 0.0) + kl.item() if kl is not None else kl_v
                    parts.append((mi, met.pop("samples", None)))
                    mets.append(met)
                entropy = ent_sum / ent_n if ent_n else float("nan")
                met = _mean_metrics(mets)
            update_index += 1
            per_sample = [(mi.idx, s) for mi, s in parts if s is not None]
            if per_sample:  # one entry per mini-batch: the weights in sample_figures are per update
                samples.append((np.concatenate([i for i, _ in per_sample]),
                                {key: torch.cat([s[key].detach().float() for _, s in per_sample])
                                 for key in per_sample[0][1]}))
            loss_metrics.update(dict.fromkeys(met))
            # the policy's entropy on its own samples (a peer's text says little about the learner's)
            # how far the step moved the weights, relative to their norm: "small step" per model
            utw = opt.last_update_to_weight
            logs.append({"loss": loss_v, "grad_norm": gn, "entropy": entropy,
                         **({"kl": kl_v} if kl_v is not None else {}),
                         **({"update_to_weight": utw} if utw is not None else {}), **met})
    opt.save_state(out_state)
    if shard is not None:  # rank 0 reports for all: the ranks' figures, gathered
        gap_all = _gather(gen_gap)
        gen_gap = max(gap_all)
        logs = [{k: float(np.nanmean([x[k] for x in per if k in x])) for k in dict.fromkeys(k for x in per for k in x)}
                for per in zip(*_gather(logs))]
        samples = [s for per in _gather(samples) for s in per]
    secs = time.time() - t0
    n_tok = int(sum(len(x) for x in batch["input_response_ids"]))
    summary = _summary(logs)
    if "kl" in summary:
        summary["kl_to_init"] = summary.pop("kl")
    if kl_before is not None:
        summary["kl_init_before_step"] = kl_before
    rewards = adv_inp.rewards
    if samples:
        summary.update(sample_figures(samples, batch["producer"].to_numpy(), agent.name))
        if loss_reg.hooks is not None:  # the loss's own step figures (SGT: its rescues)
            summary.update(loss_reg.hooks.figures(samples, batch))
    return {"samples": len(batch), "updates": len(logs), "total_updates": opt.state.updates, **summary,
            # the first update's ratio on the learner's own samples (1 by construction); absent
            # when that update holds none
            **({"first_ratio_mean": logs[0]["ratio_mean"]}
               if logs and np.isfinite(logs[0].get("ratio_mean", np.nan)) else {}),
            # the loss's own figures and the gradient norm per update, in update order (null where
            # not defined): an update whose samples are all clipped has a small gradient, yet Adam
            # still moves the weights along its momentum
            "per_update": {k: [x[k] if k in x and np.isfinite(x[k]) else None for x in logs]
                           for k in [*loss_metrics, "grad_norm", "update_to_weight"]},
            # the learner's own samples only: a sharing algorithm's peer rows (SGT's injected
            # successes, HACPO's cross samples) would otherwise make the learner look better
            "reward_mean": float(rewards[is_self_all].mean()) if bool(is_self_all.any()) else 0.0,
            **({"reward_mean_pooled": float(rewards.mean())} if bool((~is_self_all).any()) else {}),
            "adv_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
            "cross_samples": int((~is_self_all).sum()),
            **({"rows_dropped_by_loss": offered - len(batch)} if loss_reg.rows is not None else {}),
            # forwards per epoch when the memory budget cut the mini-batches (else one per update)
            **({"micro_batches": sum(1 for mb in packed for mi in mb if not mi.phantom)} if split_mbs else {}),
            "gen_vs_train_logprob_maxdiff": gen_gap, "old_logprobs_recomputed": recomputed,
            "seconds": round(secs, 2),
            "tokens_per_s": round(n_tok * tc.epochs / max(secs, 1e-9), 1)}
