"""Which rows each optimizer update of a learner's step trains on: the update layouts.

A learner's step takes several optimizer updates (mini-batches) over its training rows. How the
rows are cut into mini-batches is the algorithm's choice (``algorithm.minibatch_order``,
docs/ALGORITHMS.md "Update layout"); every layout keeps a prompt's rows of one source together.
With data parallelism, every rank lays out the same mini-batches and trains on its share of
each (:func:`rank_rows`). Pure functions of the rows, the config and a seed.
"""

from __future__ import annotations

import random

import numpy as np
import pandas as pd

from hacrl.config.schema import Config


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


def update_order(n_minibatches: int, cfg: Config, seed: int) -> list[int]:
    """The mini-batches in the order the step's updates take them, over ``trainer.epochs``
    epochs: the layout's order in the first epoch; under ``prompt_groups`` each later epoch
    reshuffles it (seeded), the other layouts keep their blocks in order."""
    rng = random.Random(seed)
    order = list(range(n_minibatches))
    out: list[int] = []
    for epoch in range(cfg.trainer.epochs):
        if epoch > 0 and cfg.algorithm.minibatch_order == "prompt_groups":
            rng.shuffle(order)
        out += order
    return out
