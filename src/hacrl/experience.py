"""The experience record (SEE) and each learner's training input.

Agents *publish* typed records; each learner *subscribes* with the filter its algorithm needs
(ALGORITHMS.md §2.1). Version 1 of the record carries everything the later algorithms read:
producer and its tokenizer, prompt, response text and token ids, the producer's per-token
log-probs, reward and verdict, the producer's own group advantage, and the step.
"""

from __future__ import annotations

import pandas as pd

SCHEMA_VERSION = 1

RECORD_COLUMNS = [
    "record_id", "schema_version", "step", "producer", "producer_tokenizer", "prompt_id",
    "problem", "gold", "level", "rendered_prompt", "prompt_token_ids", "response_text",
    "response_token_ids", "response_logprobs", "finish_reason", "sample_index",
    "reward", "verdict", "advantage",
]

LEARNER_COLUMNS = RECORD_COLUMNS + [
    "learner", "is_self", "input_prompt_ids", "input_response_ids", "old_logprobs",
]


def publish(rollouts: pd.DataFrame, rewards: pd.DataFrame, advantage_fn, eps: float = 1e-6) -> pd.DataFrame:
    """Join one agent's rollouts with their verdicts into typed experience records.

    Samples whose gold answer does not parse (reward None) are dropped here: they carry no
    signal. ``advantage`` is the producer's own group-normalised advantage.
    """
    import torch

    df = rollouts.merge(rewards[["record_id", "reward", "verdict"]], on="record_id", how="inner",
                        validate="one_to_one")
    if len(df) != len(rollouts):
        raise ValueError(f"rewards cover {len(df)} of {len(rollouts)} rollout records")
    df = df[df["reward"].notna()].copy()
    codes, _ = pd.factorize(df["prompt_id"])
    adv = advantage_fn(torch.tensor(df["reward"].to_numpy(), dtype=torch.float32),
                       torch.tensor(codes, dtype=torch.long), eps)
    df["advantage"] = adv.numpy()
    df["schema_version"] = SCHEMA_VERSION
    return df[RECORD_COLUMNS].reset_index(drop=True)


def subscribe(stream: pd.DataFrame, learner: str, mode: str) -> pd.DataFrame:
    """A learner's training input from the published stream.

    ``mode == "self"``: only the learner's own records, whose token ids and generation
    log-probs are used as they are (on-policy). Cross-agent subscriptions (HACPO, PRP, SGT)
    add retokenised peer records here in later issues.
    """
    if mode != "self":
        raise NotImplementedError(f"subscription {mode!r} is not implemented yet")
    df = stream[stream["producer"] == learner].copy()
    df["learner"] = learner
    df["is_self"] = True
    df["input_prompt_ids"] = df["prompt_token_ids"]
    df["input_response_ids"] = df["response_token_ids"]
    df["old_logprobs"] = df["response_logprobs"]
    return df[LEARNER_COLUMNS].reset_index(drop=True)
