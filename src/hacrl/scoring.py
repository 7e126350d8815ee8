"""Per-token log-probabilities: the one forward pass the trainer and the checks share.

Two traps make generation-time and training-time log-probs disagree (both measured here): position
ids under left padding (GPT-2 is off by up to 16 nats without them) and the sampling
temperature. Both are handled here, for any padding side.
"""

from __future__ import annotations

import torch


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int):
    """Left-pad ``prompt + response`` sequences into a batch.

    Returns ``input_ids`` (B, L), ``attention_mask`` (B, L) and ``response_mask`` (B, L-1), the
    latter aligned with :func:`token_logprobs` output (entry j scores token j+1).
    """
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    L = max(len(s) for s in seqs)
    B = len(seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    resp = torch.zeros((B, L - 1), dtype=torch.float32)
    for i, (s, r) in enumerate(zip(seqs, response_ids)):
        input_ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        attn[i, L - len(s):] = 1
        if r:
            resp[i, L - 1 - len(r):] = 1.0
    return input_ids, attn, resp


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False):
    """Log-prob of each next token under ``model`` at ``temperature``: shape (B, L-1).

    With ``with_entropy`` also returns the per-position entropy of the same distribution.
    The forward runs where the model is (a GPU for a DeepSpeed engine there); the results come
    back on the inputs' device, so advantages, masks and losses never care where it ran (the
    copy is differentiable, and only (B, L-1) values cross, never the logits).
    """
    where = input_ids.device
    dev = next(model.parameters()).device
    if dev != where:
        input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    logits = out.logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    if not with_entropy:
        return logp.to(where)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp.to(where), entropy.to(where)
