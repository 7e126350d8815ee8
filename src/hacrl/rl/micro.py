"""Micro-batches: a mini-batch cut to fit a memory budget, its losses normalised as a whole.

A mini-batch is one optimizer update (what the algorithm and the update layout define). What
one forward holds is set by a budget instead (``trainer.micro_batch_tokens``, padded tokens, and
``trainer.micro_batch_samples``, rows): :func:`plan` cuts the mini-batch into micro-batches
within it, rows of similar length together; gradients accumulate and the optimizer steps once.

Every registered loss writes its means with :func:`hacrl.rl.algorithms.row_mean` /
:func:`~hacrl.rl.algorithms.sum_over_count` over a :class:`~hacrl.rl.algorithms.Shard` and
branches only on the counts the shard returns (the contract data parallelism already needs).
A micro-batch then computes its share of the mini-batch's loss exactly: before the first
forward, :class:`Recorder` runs the loss on every micro-batch with the old log-probs in place of
the new ones and notes each count it asks for; the sums over micro-batches (and ranks) are the
mini-batch's counts, which :class:`Replay` gives back, in the same order, to the real pass. So a
token mean divides by the mini-batch's tokens, a sequence mean by its rows, a KL term likewise,
whatever the cut. A loss that reads whole prompt groups (SGT's gate) declares it at
registration (``split="groups"``) and is cut between groups only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from hacrl.rl.algorithms import Shard

log = logging.getLogger(__name__)


def plan(lengths: np.ndarray, groups: np.ndarray | None, max_tokens: int, max_rows: int) -> tuple[list[np.ndarray], int]:
    """Micro-batches of a mini-batch: positions (into ``lengths``) of each, in ascending order.

    ``lengths``: each row's padded length (prompt + response tokens); ``groups``: a prompt id per
    row when the loss reads whole groups (then a group is never cut), else None. A micro-batch
    holds at most ``max_tokens`` padded tokens (its rows x its longest row) and ``max_rows``
    rows; 0 is no limit. Units (rows, or groups) go longest first into the open micro-batch
    while it fits (so rows of similar length share one and pad little). Returns the
    micro-batches and how many units were over the budget on their own (each then is a
    micro-batch alone: nothing is truncated). No limit: one micro-batch, the rows in order."""
    n = len(lengths)
    if n == 0:
        return [], 0
    if max_tokens <= 0 and max_rows <= 0:
        return [np.arange(n)], 0
    if groups is None:
        units = [np.array([i]) for i in range(n)]
    else:
        order = list(dict.fromkeys(groups.tolist()))
        units = [np.flatnonzero(groups == g) for g in order]
    unit_len = [int(lengths[u].max()) for u in units]
    ranked = sorted(range(len(units)), key=lambda k: (-unit_len[k], k))  # longest first, stable
    out: list[list[int]] = []
    over = 0
    cur: list[int] = []
    cur_len = 0
    for k in ranked:
        u, ln = units[k], unit_len[k]
        rows = len(cur) + len(u)
        fits = (max_tokens <= 0 or rows * max(cur_len, ln) <= max_tokens) and (max_rows <= 0 or rows <= max_rows)
        if cur and not fits:
            out.append(cur)
            cur, cur_len = [], 0
        if not cur and ((max_tokens > 0 and len(u) * ln > max_tokens) or (max_rows > 0 and len(u) > max_rows)):
            over += 1
        cur = cur + u.tolist()
        cur_len = max(cur_len, ln)
    if cur:
        out.append(cur)
    return [np.array(sorted(m)) for m in out], over


@dataclass
class Recorder(Shard):
    """Notes the counts a loss asks for on one micro-batch (and answers with the local value,
    so that the recording pass runs; its loss is thrown away)."""

    values: list[float] = field(default_factory=list)

    @property
    def split(self) -> bool:
        return True

    def all_sum(self, v) -> float:
        v = float(v)
        self.values.append(v)
        return v


@dataclass
class Replay(Shard):
    """Gives a micro-batch's loss the mini-batch's counts, in the order the loss asks for them."""

    totals: list[float] = field(default_factory=list)
    asked: int = 0

    @property
    def split(self) -> bool:
        return True

    def all_sum(self, v) -> float:
        if self.asked >= len(self.totals):
            raise RuntimeError("the loss asked for more counts on this micro-batch than it did when they were "
                               "recorded: it branches on something other than the counts it is given")
        t = self.totals[self.asked]
        self.asked += 1
        return t


def totals(records: list[list[float]], dp: Shard | None = None) -> list[float]:
    """The mini-batch's counts from each micro-batch's recorded ones (position by position), and
    over every rank when data-parallel (``dp``: one collective for the lot)."""
    sizes = {len(r) for r in records}
    if len(sizes) > 1:
        raise RuntimeError(f"the loss asked for {sorted(sizes)} counts on different micro-batches: it branches on "
                           "local values, so it cannot be cut into micro-batches exactly")
    k = sizes.pop() if sizes else 0
    sums = np.zeros(k, dtype=np.float64)
    for r in records:
        sums += np.asarray(r, dtype=np.float64)
    if dp is not None and dp.world_size > 1 and k:
        import torch
        import torch.distributed as dist

        dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(sums, dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        sums = t.cpu().numpy()
    return [float(x) for x in sums]
