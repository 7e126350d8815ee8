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
    "behavior_logprob_mean", "retokenized_exact",
]
"""A learner's training input: the record plus the learner's view of it. ``input_*_ids`` are in
the learner's tokenizer (retokenised for cross records, the prompt rendered with the learner's
template); ``old_logprobs`` are the generation log-probs per token for self records (empty for
cross records, whose tokens differ); ``behavior_logprob_mean`` is the producer's mean
generation log-prob over its own tokens (HACPO's cross-ratio denominator);
``retokenized_exact`` says decode(encode(text)) == text in the learner's tokenizer."""


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


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if len(xs) else 0.0


def subscribe(stream: pd.DataFrame, learner: str, mode: str, tokenizer=None, template: str | None = None) -> pd.DataFrame:
    """A learner's training input from the published stream.

    ``mode == "self"``: only the learner's own records, whose token ids and generation
    log-probs are used as they are (on-policy). ``mode == "all"``: every agent's records of the
    step, the learner's own first; a peer's response is detokenised (its text) and retokenised
    with the learner's ``tokenizer``, its prompt rendered with the learner's ``template`` (an
    EOS is appended when the producer stopped); peer responses that retokenise to nothing are
    dropped.
    """
    if mode not in ("self", "all"):
        raise NotImplementedError(f"subscription {mode!r} is not implemented")
    own = stream[stream["producer"] == learner].copy()
    own["learner"] = learner
    own["is_self"] = True
    own["input_prompt_ids"] = own["prompt_token_ids"]
    own["input_response_ids"] = own["response_token_ids"]
    own["old_logprobs"] = own["response_logprobs"]
    own["behavior_logprob_mean"] = [_mean(x) for x in own["response_logprobs"]]
    own["retokenized_exact"] = True
    if mode == "self":
        return own[LEARNER_COLUMNS].reset_index(drop=True)
    if tokenizer is None or template is None:
        raise ValueError("subscription 'all' needs the learner's tokenizer and template")
    peers = stream[stream["producer"] != learner].copy()
    eos = tokenizer.eos_token_id
    prompt_ids: dict[str, list[int]] = {}
    for pid, problem in zip(peers["prompt_id"], peers["problem"]):
        if pid not in prompt_ids:
            prompt_ids[pid] = tokenizer(template.replace("{problem}", problem), add_special_tokens=False)["input_ids"]
    resp_ids, exact = [], []
    for text, finish in zip(peers["response_text"], peers["finish_reason"]):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        exact.append(tokenizer.decode(ids, skip_special_tokens=True) == text)
        resp_ids.append(ids + ([eos] if finish == "stop" and eos is not None else []))
    peers["learner"] = learner
    peers["is_self"] = False
    peers["input_prompt_ids"] = [prompt_ids[p] for p in peers["prompt_id"]]
    peers["input_response_ids"] = resp_ids
    peers["old_logprobs"] = [[] for _ in range(len(peers))]
    peers["behavior_logprob_mean"] = [_mean(x) for x in peers["response_logprobs"]]
    peers["retokenized_exact"] = exact
    peers = peers[[len(x) > 0 for x in peers["input_response_ids"]]]
    return pd.concat([own[LEARNER_COLUMNS], peers[LEARNER_COLUMNS]], ignore_index=True)
