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


def response_span(response_mask: torch.Tensor) -> int:
    """How many trailing positions of a :func:`pack` batch hold response tokens (left padding puts
    every response at the end, so the last ``span`` entries of (B, L-1) cover them all)."""
    nz = response_mask.sum(-1)
    return int(nz.max()) if nz.numel() else 0


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False, span: int | None = None):
    """Log-prob of each next token under ``model`` at ``temperature``: shape (B, L-1).

    With ``with_entropy`` also returns the per-position entropy of the same distribution.
    ``span``: score only the last ``span`` positions (the responses of a :func:`pack` batch, see
    :func:`response_span`); the others come back as 0. The language-model head then projects
    ``span`` positions instead of L: with a real vocabulary (49k-150k) the full-sequence logits
    are most of an update's memory. The log-probs are the same bits either way; gradients agree
    to float rounding (the head's weight gradient sums over fewer rows).
    The forward runs where the model is (a GPU for a DeepSpeed engine there); the results come
    back on the inputs' device, so advantages, masks and losses never care where it ran (the
    copy is differentiable, and only (B, L-1) values cross, never the logits).
    """
    where = input_ids.device
    dev = next(model.parameters()).device
    if dev != where:
        input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
    L = input_ids.shape[1]
    keep = L - 1 if span is None else max(1, min(int(span), L - 1))
    kw = {"logits_to_keep": keep + 1} if span is not None else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, **kw)
    logits = out.logits[:, -(keep + 1):-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, L - keep:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    if keep < L - 1:  # the prompt positions nobody scores
        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.new_zeros(x.shape[0], L - 1 - keep), x], dim=1)
        logp = pad(logp)
        entropy = pad(entropy) if entropy is not None else None
    if not with_entropy:
        return logp.to(where)
    return logp.to(where), entropy.to(where)
