"""One learner's policy update on its training input (the body of update-policies).

:func:`train_learner` reads as one RL step, in named parts:

1. :func:`plan_step`: the rows the loss can use, their advantages (the registered estimator),
   the layout's mini-batches (:mod:`hacrl.rl.layout`; this rank's prompt groups when
   data-parallel), each cut into micro-batches within the memory budget (:mod:`hacrl.rl.micro`;
   a whole mini-batch is a list of one);
2. :func:`old_logprobs`: pi_old of every micro-batch before the first update, and the reference
   model's log-probs for the KL term;
3. :func:`run_update`, once per optimizer update: one loop over the mini-batch's micro-batches
   (forward, registered loss + KL, backward; the optimizer steps after the last one);
4. :func:`step_figures`: the step's figures from its updates' (each exact over micro-batches and
   ranks: :mod:`hacrl.rl.figures`).

The loss functions live in :mod:`hacrl.rl.algorithms`; nothing here names an algorithm or an
engine.
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
from hacrl.agents.scoring import pack, response_span, shared_prefix_logprobs, token_logprobs
from hacrl.config.schema import Config
from hacrl.groups import pooled_reward_stats
from hacrl.rl import figures as fig
from hacrl.rl import norm_match
from hacrl.rl.algorithms import ADVANTAGES, LOSSES, AdvantageInputs, LossInputs, Shard, kl_k3, masked_mean
from hacrl.rl.layout import layout, rank_rows, update_order
from hacrl.rl.micro import Recorder, Replay
from hacrl.rl.micro import plan as plan_micro
from hacrl.rl.micro import totals as micro_totals
from hacrl.rl.trainer import PolicyOptimizer, seed_rng, world
from hacrl.rollout.table import engine_spec

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- 1. the plan

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
    prompts: list = dataclasses.field(default_factory=list)
    """Each row's prompt and response ids (the shared-prefix forward reads them)."""
    responses: list = dataclasses.field(default_factory=list)
    pad: int = 0
    phantom: bool = False
    """A rank's stand-in micro-batch when it has fewer than another rank (its loss weighs 0)."""


def _aligned(values: list[list[float]], resp_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of each response placed at the response positions of ``resp_mask``."""
    out = torch.zeros_like(resp_mask)
    L = resp_mask.shape[1]
    for i, v in enumerate(values):
        if len(v):
            out[i, L - len(v):] = torch.tensor(v, dtype=out.dtype)
    return out


def pack_micro(batch: pd.DataFrame, idx: np.ndarray, pad: int, response_only: bool) -> Micro:
    """Rows ``idx`` of the learner's batch, left-padded into one forward's tensors."""
    rows = batch.iloc[idx]
    prompts, responses = [list(x) for x in rows["input_prompt_ids"]], [list(x) for x in rows["input_response_ids"]]
    ids, attn, resp = pack(prompts, responses, pad)
    return Micro(idx, ids, attn, resp, _aligned([list(x) for x in rows["old_logprobs"]], resp),
                 _aligned([list(x) for x in rows["behavior_logprobs_aligned"]], resp),
                 response_span(resp) if response_only else None, prompts, responses, pad)


def _all_max(values: list[int]) -> list[int]:
    """Each position's maximum over the ranks (a collective)."""
    import torch.distributed as dist

    dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


@dataclass
class StepPlan:
    """What one learner's step trains on, laid out for its updates."""

    batch: pd.DataFrame
    """The rows trained on (those the loss can use; see ``Registered.rows``)."""
    offered: int
    """Rows before the loss's row filter."""
    inputs: AdvantageInputs
    advantages: torch.Tensor
    choice_key: torch.Tensor
    """A seeded uniform key per row, for losses that choose among rows at random."""
    omega_src: torch.Tensor
    """omega[source][learner] of each row: the discrepancy coefficient."""
    behavior_mean: torch.Tensor
    minibatches: list[list[Micro]]
    """Per mini-batch (one optimizer update) this rank's micro-batches; a whole one is a list of one."""
    minibatch_rows: list[int]
    """Rows of each mini-batch over every rank (a per-sample figure weighs 1 / this)."""
    own_rows: list[int]
    """The learner's own rows of each mini-batch over every rank: a KL term only where > 0."""
    shard: Shard | None
    """Data parallelism (None: one process)."""

    @property
    def world_size(self) -> int:
        return self.shard.world_size if self.shard is not None else 1

    @property
    def split(self) -> bool:
        """Whether any mini-batch is cut into micro-batches."""
        return any(len(mb) > 1 for mb in self.minibatches)


def cut_minibatches(batch: pd.DataFrame, mbs: list[np.ndarray], groups: np.ndarray | None, cfg: Config,
                    pad: int, name: str) -> list[list[Micro]]:
    """Each mini-batch cut into micro-batches within ``trainer.micro_batch_tokens`` /
    ``micro_batch_samples`` (one when there is no budget); ``groups``: a prompt code per row
    when the loss reads whole groups (then a group is never cut)."""
    tc = cfg.trainer
    lengths = (batch["input_prompt_ids"].map(len) + batch["input_response_ids"].map(len)).to_numpy()
    packed, over = [], 0
    for idx in mbs:
        parts, o = plan_micro(lengths[idx], groups[idx] if groups is not None else None, tc.micro_batch_tokens,
                              tc.micro_batch_samples)
        over += o
        packed.append([pack_micro(batch, idx[part], pad, tc.response_logits_only) for part in parts])
    if over:
        log.warning("%s: %d %s longer than trainer.micro_batch_tokens=%d (or more rows than micro_batch_samples=%d): "
                    "each is a micro-batch of its own (nothing is truncated)", name, over,
                    "prompt groups" if groups is not None else "rows", tc.micro_batch_tokens, tc.micro_batch_samples)
    return packed


def add_phantoms(packed: list[list[Micro]], name: str) -> None:
    """Every rank takes as many micro-batches per update (ZeRO 2 reduces at each): a rank with
    fewer runs phantom ones (its smallest again, weighted 0). A collective, which every rank calls
    whether or not its own share was cut: then every rank sees the same counts (a cut update on
    one rank is a cut update on all), and takes the same branches with the same collectives."""
    need = [int(x) for x in _all_max([len(mb) for mb in packed])]
    phantoms = sum(n - len(mb) for mb, n in zip(packed, need))
    for mb, n in zip(packed, need):
        while len(mb) < n:
            mb.append(dataclasses.replace(min(mb, key=lambda x: x.ids.numel()), phantom=True))
    if phantoms:
        log.info("%s: rank %d runs %d phantom micro-batches (another rank needs more)", name, world()[0], phantoms)


def plan_step(agent: Agent, batch: pd.DataFrame, cfg: Config, seed: int, omega: dict | None,
              reward_stats: pd.DataFrame | None) -> StepPlan:
    """The step's rows, advantages, and mini-batches cut into micro-batches (see :class:`StepPlan`)."""
    a = cfg.algorithm
    inputs = advantage_inputs(batch, cfg, agent.name, omega, reward_stats)
    loss_reg = LOSSES[a.loss.name]
    offered = len(batch)
    if loss_reg.rows is not None:  # rows the loss can never use cost no forward pass
        batch = batch[loss_reg.rows(inputs, a.loss).numpy()].reset_index(drop=True)
        inputs = advantage_inputs(batch, cfg, agent.name, omega, reward_stats)
    rank, world_size = world()
    full = layout(batch, cfg, agent.name, seed)
    # data parallelism: every rank lays out the same mini-batches and keeps its prompt groups
    mbs = [rank_rows(batch["prompt_id"], idx, rank, world_size) for idx in full]
    # whole prompt groups per micro-batch where the loss reads a group, or where the rows of one
    # prompt share its forward (trainer.share_prompt_prefix)
    groups = inputs.group_ids.numpy() if loss_reg.split == "groups" or cfg.trainer.share_prompt_prefix else None
    packed = cut_minibatches(batch, mbs, groups, cfg, agent.tokenizer.pad_token_id, agent.name)
    if world_size > 1:  # every rank, cut or not: the ranks agree on each update's micro-batch count
        add_phantoms(packed, agent.name)
    return StepPlan(
        batch=batch, offered=offered, inputs=inputs, advantages=ADVANTAGES[a.advantage.name].fn(inputs, a.advantage),
        choice_key=torch.tensor([random.Random(f"{seed}/{rid}").random() for rid in batch["record_id"]],
                                dtype=torch.float32),
        omega_src=inputs.omega[inputs.source_ids, inputs.learner],
        behavior_mean=torch.tensor(batch["behavior_logprob_mean"].to_numpy(), dtype=torch.float32),
        minibatches=packed, minibatch_rows=[len(idx) for idx in full],
        own_rows=[int(inputs.is_self[idx].sum()) for idx in full],
        shard=Shard(world_size) if world_size > 1 else None)


# ----------------------------------------------------------------------------- 2. old log-probs

def forward(model, mi: Micro, cfg: Config, with_entropy: bool = False):
    """The model's per-token log-probs (and entropies) on a micro-batch at the sampling temperature
    (each distinct prompt run once with ``trainer.share_prompt_prefix``)."""
    if cfg.trainer.share_prompt_prefix:
        return shared_prefix_logprobs(model, mi.prompts, mi.responses, mi.pad, mi.ids.shape[1],
                                      cfg.rollout.temperature, with_entropy, cfg.trainer.logprob_chunk)
    return token_logprobs(model, mi.ids, mi.attn, cfg.rollout.temperature, with_entropy=with_entropy, span=mi.span,
                          chunk=cfg.trainer.logprob_chunk)


@dataclass
class OldPolicy:
    """pi_old of every micro-batch (the policy before the step's first update), the reference
    model's log-probs when a KL term needs them, and what scoring them measured."""

    logp: list[list[torch.Tensor | None]]
    """None until taken: the first mini-batch's is its first training forward (see :func:`old_logprobs`)."""
    ref: list[list[torch.Tensor]] | None
    use_generation: bool
    """Own samples keep the engine's generation log-probs (an exact engine, no recompute)."""
    gen_gap: float = 0.0
    """The largest |generation - trainer| log-prob on an own token the trainer scored."""
    recomputed: int = 0
    """Rows whose pi_old the trainer scored in a no-grad pass."""
    unmeasured: set = dataclasses.field(default_factory=set)
    """First-update micro-batches (0, k) whose pi_old came from generation without a trainer pass:
    their first training forward, at the step's weights, measures the gap (:meth:`measure`)."""

    def measure(self, mi: Micro, lp: torch.Tensor, is_self: torch.Tensor) -> None:
        """Note how far the generation log-probs are from the trainer's ``lp`` on own tokens."""
        self_mask = mi.resp * is_self[mi.idx][:, None]
        if bool(self_mask.any()):
            self.gen_gap = max(self.gen_gap, float(((lp - mi.gen_lp).abs() * self_mask).max()))

    def take(self, m: int, k: int, mi: Micro, lp: torch.Tensor, is_self: torch.Tensor) -> torch.Tensor:
        """Micro-batch (m, k)'s pi_old from the trainer's log-probs ``lp`` at the step's start
        (the generation log-probs on own tokens where ``use_generation``); notes the gap."""
        self.measure(mi, lp, is_self)
        self_mask = mi.resp * is_self[mi.idx][:, None]
        self.logp[m][k] = torch.where(self_mask.bool(), mi.gen_lp, lp) if self.use_generation else lp
        return self.logp[m][k]


def old_logprobs(model, ref_model, plan: StepPlan, cfg: Config) -> OldPolicy:
    """pi_old (and pi_ref) of every micro-batch, one micro-batch at a time, without gradients.

    ``trainer.recompute_old_logprobs`` (verl's "recompute"): the trainer's own forward for every
    sample, so the first update's ratio is exactly 1. Off: a micro-batch of own samples of an
    engine whose generation log-probs are the trainer's (``exact_logprobs``) keeps them, no pass
    (the first update's forward measures the gap); other rows (cross samples, in another
    tokenizer's tokens; vLLM's kernels) are still scored, unless the loss never reads pi_old on
    peers' rows (HACPO) and the micro-batch holds no own row. When nothing needs every pi_old
    before the first update (no KL reference, no micro-batch counts), the first mini-batch's
    pi_old is its first training forward, detached: the same bits as a no-grad pass
    (tests/rl/test_update_speed.py), one forward fewer. The reference model scores the
    micro-batches that hold own rows only (the KL term and its measurement read no other).
    """
    use_gen = not cfg.trainer.recompute_old_logprobs and engine_spec(cfg.rollout.engine).exact_logprobs
    old = OldPolicy([[None] * len(mb) for mb in plan.minibatches], None, use_gen)
    is_self = plan.inputs.is_self
    deferred = ref_model is None and not plan.split
    # a micro-batch of peers' rows only, for a loss that never reads pi_old there, needs no pass
    unread = [[not LOSSES[cfg.algorithm.loss.name].reads_peer_old and not bool(is_self[mi.idx].any()) for mi in mb]
              for mb in plan.minibatches]
    with torch.no_grad():
        for m, mb in enumerate(plan.minibatches):
            for k, mi in enumerate(mb):
                if unread[m][k]:
                    old.logp[m][k] = torch.zeros_like(mi.gen_lp)
                    continue
                if deferred and m == 0:
                    continue
                if use_gen and bool(is_self[mi.idx].all()):  # own samples of an exact engine
                    old.logp[m][k] = mi.gen_lp
                    if m == 0:
                        old.unmeasured.add((m, k))
                    continue
                old.take(m, k, mi, forward(model, mi, cfg), is_self)
                old.recomputed += 0 if mi.phantom else len(mi.idx)
        if ref_model is not None:  # the KL term and its measurement read own rows only
            old.ref = [[forward(ref_model, mi, cfg) if bool(is_self[mi.idx].any()) else torch.zeros_like(mi.gen_lp)
                        for mi in mb] for mb in plan.minibatches]
    return old


def kl_old_to_ref(plan: StepPlan, old: OldPolicy) -> float | None:
    """KL(pi_old || pi_ref) by k3 over the learner's own samples (drawn from pi_old), one value
    per sample then their mean (over every rank's samples when sharded); None without own
    samples or without a reference."""
    if old.ref is None:
        return None
    per = []
    for mb, ob, rb in zip(plan.minibatches, old.logp, old.ref):
        for mi, o, r in zip(mb, ob, rb):
            sm = mi.resp * plan.inputs.is_self[mi.idx][:, None]
            rows = sm.sum(1) > 0
            if not mi.phantom and bool(rows.any()):
                d = r - o
                per.append(masked_mean(torch.exp(d) - d - 1, sm, dim=1)[rows])
    if plan.shard is not None:
        vals = torch.cat(per) if per else torch.zeros(0)
        n = plan.shard.all_sum(vals.numel())
        return plan.shard.all_sum(float(vals.sum())) / n if n else None
    return float(torch.cat(per).mean()) if per else None


# ----------------------------------------------------------------------------- 3. one update

def objective(plan: StepPlan, m: int, k: int, logp: torch.Tensor, old: OldPolicy, cfg: Config, update_index: int,
              counts: Shard | None, loss_opts=None) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    """Micro-batch k of mini-batch m: the registered loss, plus the KL term on the learner's own
    samples where the mini-batch holds any (an update of cross samples only has none).
    ``counts``: where the loss's means take their counts (None: this micro-batch is the whole
    mini-batch in this process); ``loss_opts``: other options of the same loss (the norm-matched
    control's own-only ones)."""
    a = cfg.algorithm
    mi = plan.minibatches[m][k]
    idx, inp = mi.idx, plan.inputs
    loss, met = LOSSES[a.loss.name].fn(
        LossInputs(logp=logp, old_logp=old.logp[m][k], mask=mi.resp, advantages=plan.advantages[idx],
                   is_self=inp.is_self[idx], omega_src=plan.omega_src[idx], behavior_logp=mi.behavior,
                   behavior_logp_mean=plan.behavior_mean[idx], update_index=update_index, rewards=inp.rewards[idx],
                   group_ids=inp.group_ids[idx], verified=inp.verified[idx], choice_key=plan.choice_key[idx],
                   shard=counts), loss_opts if loss_opts is not None else a.loss)
    kl = None
    if old.ref is not None and a.kl_coef > 0 and plan.own_rows[m] > 0:
        kl = kl_k3(logp, old.ref[m][k], mi.resp * inp.is_self[idx][:, None], counts, a.kl_clamp)
        loss = loss + a.kl_coef * kl
    return loss, met, kl


def minibatch_counts(plan: StepPlan, m: int, old: OldPolicy, cfg: Config, update_index: int) -> list[float]:
    """The counts the loss asks for over the whole of a cut mini-batch: recorded micro-batch by
    micro-batch with pi_old in place of the new log-probs, summed (and over the ranks)."""
    recorded = []
    with torch.no_grad():
        for k, mi in enumerate(plan.minibatches[m]):
            rec = Recorder(plan.world_size)
            objective(plan, m, k, old.logp[m][k], old, cfg, update_index, rec)
            if not mi.phantom:
                recorded.append(rec.values)
    return micro_totals(recorded, plan.shard)


def norm_matched(opt: PolicyOptimizer, plan: StepPlan, m: int, old: OldPolicy, cfg: Config,
                 update_index: int) -> tuple[float, int, object, dict]:
    """The norm-matched control's update m (:mod:`hacrl.rl.norm_match`): ``(c, p, own-only
    options, figures)``, the gradients measured at the update's weights, before it steps."""
    own_opts = LOSSES[cfg.algorithm.loss.name].own_only(cfg.algorithm.loss)
    params = [q for q in opt.module.parameters() if q.requires_grad]
    p = norm_match.partner(plan.own_rows, m)
    cross = [torch.zeros_like(q) for q in params]
    own = {b: [torch.zeros_like(q) for q in params] for b in dict.fromkeys((m, p))}
    for b in own:
        mb = plan.minibatches[b]
        totals = minibatch_counts(plan, b, old, cfg, update_index) if len(mb) > 1 else None
        for k, mi in enumerate(mb):
            # the bare module: its gradients are read, not accumulated (DeepSpeed's engine refuses that)
            logp = forward(opt.module, mi, cfg)
            if old.logp[b][k] is None:  # the step's first forward: it is pi_old
                old.take(b, k, mi, logp.detach(), plan.inputs.is_self)

            def counts():
                return plan.shard if totals is None else Replay(plan.world_size, totals=totals)

            if b == m:  # g_cross = g(loss) - g(loss without its cross terms)
                g_full = norm_match.grads(objective(plan, b, k, logp, old, cfg, update_index, counts())[0], params,
                                          retain=True)
                g_own = norm_match.grads(objective(plan, b, k, logp, old, cfg, update_index, counts(), own_opts)[0],
                                         params)
                cross = [a + f - o for a, f, o in zip(cross, g_full, g_own)]
            else:
                g_own = norm_match.grads(objective(plan, b, k, logp, old, cfg, update_index, counts(), own_opts)[0],
                                         params)
            own[b] = [a + o for a, o in zip(own[b], g_own)]
    c, figures = norm_match.scale_of(cross, own[p])
    return c, p, own_opts, figures


def reaches_model(loss: torch.Tensor, logp: torch.Tensor) -> bool:
    """Whether any gradient of ``loss`` reaches the model. A loss reads the model only through the
    log-probs ``logp`` (:func:`objective`'s one differentiable input), so its gradient there being
    exactly zero (every token clipped, every advantage and the KL term's weight 0) means the
    backward through the model would give exactly zero gradients. Costs the loss's own backward
    to ``logp`` (elementwise), not the model's."""
    if not loss.requires_grad:
        return False
    (g,) = torch.autograd.grad(loss, logp, retain_graph=True, allow_unused=True)
    return g is not None and bool(g.ne(0).any())


def run_update(opt: PolicyOptimizer, plan: StepPlan, m: int, old: OldPolicy, cfg: Config,
               update_index: int) -> tuple[dict[str, fig.Part], list]:
    """One optimizer update on mini-batch ``m``: one forward and backward per micro-batch (each
    loss its share of the mini-batch's), then the clipped step. Returns the update's figures,
    merged over its micro-batches (this rank's), and the loss's per-sample outputs.

    The norm-matched control (``algorithm.norm_match``, :mod:`hacrl.rl.norm_match`) trains on the
    own-only loss of m and, weighted ``c``, that of its partner mini-batch p (when p is m: on
    ``1 + c`` times m's); its figures are m's."""
    passes: list[tuple[int, float, object]] = [(m, 1.0, None)]
    extra: dict = {}
    if cfg.algorithm.norm_match:
        c, p, own_opts, nm = norm_matched(opt, plan, m, old, cfg, update_index)
        passes = [(m, 1.0 + c, own_opts)] if p == m else [(m, 1.0, own_opts), *([(p, c, own_opts)] if c > 0 else [])]
        extra = {k: fig.same(v) for k, v in nm.items()}
    parts, samples, gn = [], [], None
    for j, (b, weight, opts) in enumerate(passes):
        mb = plan.minibatches[b]
        totals = minibatch_counts(plan, b, old, cfg, update_index) if len(mb) > 1 else None
        for k, mi in enumerate(mb):
            logp, ent = forward(opt.model, mi, cfg, with_entropy=True)
            if old.logp[b][k] is None:  # the first mini-batch, before any update: this forward is pi_old
                old.take(b, k, mi, logp.detach(), plan.inputs.is_self)
            elif update_index == 0 and (b, k) in old.unmeasured:  # at the step's weights still
                old.measure(mi, logp.detach(), plan.inputs.is_self)
            loss, met, kl = objective(plan, b, k, logp, old, cfg, update_index,
                                      plan.shard if totals is None else Replay(plan.world_size, totals=totals), opts)
            if weight != 1.0:
                loss = weight * loss
            # a loss with no gradient (a phantom; every token clipped or weighted 0) skips the
            # backward through the model: the same all-zero gradients, at the cost of a sum
            live = not mi.phantom and reaches_model(loss, logp)
            gn = opt.micro_step(loss if live else opt.zero_loss(loss), last=j == len(passes) - 1 and k == len(mb) - 1)
            if mi.phantom or j > 0:  # a partner's pass adds its gradient, not its figures
                continue
            per_sample = met.pop("samples", None)
            if per_sample is not None:
                samples.append((mi.idx, per_sample))
            # the policy's entropy on its own samples (a peer's text says little about the learner's)
            own_tok = mi.resp * plan.inputs.is_self[mi.idx][:, None]
            parts.append({"loss": fig.share(loss), "entropy": fig.mean(ent, own_tok),
                          **({"kl": fig.share(kl)} if kl is not None else {}), **met})
    merged = fig.merge_all(parts)
    # how far the step moved the weights, relative to their norm: "small step" per model
    utw = opt.last_update_to_weight
    return {"loss": merged.pop("loss"), "grad_norm": fig.same(gn), "entropy": merged.pop("entropy"),
            **({"kl": merged.pop("kl")} if "kl" in merged else {}),
            **({"update_to_weight": fig.same(utw)} if utw is not None else {}), **merged, **extra}, samples


def with_weights(samples: list, rows: int) -> tuple[np.ndarray, dict]:
    """One update's per-sample outputs as one entry, each sample weighted 1 / the mini-batch's
    rows (over every rank), as a term enters the mini-batch's mean."""
    idx = np.concatenate([i for i, _ in samples])
    vals = {key: torch.cat([s[key].detach().float() for _, s in samples]) for key in samples[0][1]}
    vals["weight"] = torch.full((len(idx),), 1.0 / max(1, rows), dtype=torch.float64)
    return idx, vals


# ----------------------------------------------------------------------------- 4. the step's figures

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
    src = []
    for idx, vals in samples:
        src.append(producers[idx])
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
            figs = {"mean": float(r.mean()), "q10": float(q[0]), "q50": float(q[1]), "q90": float(q[2]),
                    "min": float(r.min()), "max": float(r.max()), "n": int(sel.sum())}
            for k in ("clipped_below", "clipped_above"):
                if k in cat:
                    figs[k] = float(cat[k][sel].mean())
            out.update({f"ratio/{s}/{k}": v for k, v in figs.items()})
    if "term" in cat:
        w = np.abs(cat["term"]) * cat["weight"]
        total = float(w.sum())
        out["cross_objective_share"] = float(w[src != learner].sum()) / total if total > 0 else 0.0
        if "active" in cat:
            w = w * cat["active"]
            total = float(w.sum())
            out["cross_gradient_share"] = float(w[src != learner].sum()) / total if total > 0 else 0.0
    return out


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


def step_figures(plan: StepPlan, updates: list[dict], samples: list, old: OldPolicy, opt: PolicyOptimizer,
                 cfg: Config, learner: str, secs: float) -> dict:
    """The step's figures (what update_stats.json keeps for the learner): each update's merged
    over the ranks, their summary over updates, per-update series, per-sample distributions,
    the loss's own step figures, and the step's bookkeeping."""
    gen_gap = old.gen_gap
    if plan.shard is not None:  # rank 0 reports for all: the ranks' parts, gathered and merged
        gen_gap = max(_gather(gen_gap))
        updates = [fig.merge_all(list(per), ranks=plan.world_size) for per in zip(*_gather(updates))]
        samples = [s for per in _gather(samples) for s in per]
    logs = [{k: float(v) for k, v in u.items()} for u in updates]
    summary = _summary(logs)
    if "kl" in summary:
        summary["kl_to_init"] = summary.pop("kl")
    kl_before = kl_old_to_ref(plan, old)
    if kl_before is not None:
        summary["kl_init_before_step"] = kl_before
    batch, inp, adv = plan.batch, plan.inputs, plan.advantages
    loss_reg = LOSSES[cfg.algorithm.loss.name]
    if samples:
        summary.update(sample_figures(samples, batch["producer"].to_numpy(), learner))
        if loss_reg.hooks is not None:  # the loss's own step figures (SGT: its rescues)
            summary.update(loss_reg.hooks.figures(samples, batch))
    loss_keys = dict.fromkeys(k for u in updates for k in u if k not in ("loss", "grad_norm", "entropy", "kl",
                                                                         "update_to_weight"))
    is_self = inp.is_self
    n_tok = int(sum(len(x) for x in batch["input_response_ids"]))
    return {"samples": len(batch), "updates": len(logs), "total_updates": opt.state.updates, **summary,
            # the first update's ratio on the learner's own samples (1 by construction); absent
            # when that update holds none
            **({"first_ratio_mean": logs[0]["ratio_mean"]}
               if logs and np.isfinite(logs[0].get("ratio_mean", np.nan)) else {}),
            # the loss's own figures and the gradient norm per update, in update order (null where
            # not defined): an update whose samples are all clipped has a small gradient, yet Adam
            # still moves the weights along its momentum
            # (the KL term where any update has one: none in an update without own samples)
            "per_update": {k: [x[k] if k in x and np.isfinite(x[k]) else None for x in logs]
                           for k in [*loss_keys, "grad_norm", "update_to_weight",
                                     *(["kl"] if any("kl" in x for x in logs) else [])]},
            # the learner's own samples only: a sharing algorithm's peer rows (SGT's injected
            # successes, HACPO's cross samples) would otherwise make the learner look better
            "reward_mean": float(inp.rewards[is_self].mean()) if bool(is_self.any()) else 0.0,
            **({"reward_mean_pooled": float(inp.rewards.mean())} if bool((~is_self).any()) else {}),
            "adv_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
            "cross_samples": int((~is_self).sum()),
            **({"rows_dropped_by_loss": plan.offered - len(batch)} if loss_reg.rows is not None else {}),
            # forwards per epoch when the memory budget cut the mini-batches (else one per update)
            **({"micro_batches": sum(1 for mb in plan.minibatches for mi in mb if not mi.phantom)}
               if plan.split else {}),
            # updates whose gradient was exactly zero (each a bare AdamW step unless skipped);
            # absent: none (a step's figures, and so the default run's outputs, as before)
            **({"empty_updates": n_empty} if (n_empty := sum(1 for x in logs if x["grad_norm"] == 0.0)) else {}),
            **({"skipped_updates": opt.skipped} if cfg.trainer.skip_empty_updates else {}),
            "gen_vs_train_logprob_maxdiff": gen_gap, "old_logprobs_recomputed": old.recomputed,
            "seconds": round(secs, 2),
            "tokens_per_s": round(n_tok * cfg.trainer.epochs / max(secs, 1e-9), 1)}


# ----------------------------------------------------------------------------- the step

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


def open_optimizer(agent: Agent, plan: StepPlan, cfg: Config, seed: int, prev_state: Path) -> PolicyOptimizer:
    """The learner's optimizer (DeepSpeed or torch) with its recovery state and the step's RNG."""
    tc = cfg.trainer
    if tc.gradient_checkpointing:
        enable_checkpointing(agent.model)
    rows = [sum(len(mi.idx) for mi in mb if not mi.phantom) for mb in plan.minibatches]  # this rank's, per update
    opt = PolicyOptimizer(agent.model, tc, max(rows) if rows else 1)
    seed_rng(seed)  # a first step's saved RNG state is then reproducible; a resumed one is restored
    opt.load_state(prev_state)
    train_mode(opt.model, tc.gradient_checkpointing)  # no dropout in RL updates; gradients still flow
    return opt


def train_learner(agent: Agent, batch: pd.DataFrame, cfg: Config, seed: int, prev_state: Path,
                  out_state: Path, ref_model=None, omega: dict | None = None,
                  reward_stats: pd.DataFrame | None = None) -> dict:
    """Update ``agent.model`` in place on ``batch`` (its ``learner_input`` rows); return its figures.

    ``omega``: the step's capability ratios ``omega[a][b]``; ``reward_stats``: the reward
    statistics its subscription took, if any. The configured estimator and loss are looked up
    by name. The mini-batches follow ``algorithm.minibatch_order``; m, the update index the loss
    sees, counts every update of the step (all epochs).

    Raises :class:`hacrl.rl.trainer.NonFiniteLossError` on a NaN/inf loss; the caller then
    writes no checkpoint.
    """
    t0 = time.time()
    plan = plan_step(agent, batch, cfg, seed, omega, reward_stats)
    opt = open_optimizer(agent, plan, cfg, seed, prev_state)
    old = old_logprobs(opt.model, ref_model, plan, cfg)
    updates, samples = [], []
    for update_index, m in enumerate(update_order(len(plan.minibatches), cfg, seed)):
        figures, per_sample = run_update(opt, plan, m, old, cfg, update_index)
        updates.append(figures)
        if per_sample:  # one entry per update: a sample weighs as its mini-batch's mean says
            samples.append(with_weights(per_sample, plan.minibatch_rows[m]))
    opt.save_state(out_state)
    return step_figures(plan, updates, samples, old, opt, cfg, agent.name, time.time() - t0)
