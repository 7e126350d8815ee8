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


LOGPROB_CHUNK = 1024
"""Positions whose vocabulary-wide softmax is computed at once (``trainer.logprob_chunk``): the
work space of a chunk is a few tensors of ``chunk x vocabulary x 4`` bytes, whatever the batch
(200 MB each at 1,024 positions and a 49k vocabulary)."""


def _blocks(shape: torch.Size, chunk: int):
    """(row slice, position slice) blocks of a (B, T, V) tensor covering about ``chunk`` positions
    each: whole rows together when a row is shorter than ``chunk``, else pieces of one row."""
    B, T = int(shape[0]), int(shape[1])
    if T <= chunk:
        rows = max(1, chunk // max(1, T))
        for b in range(0, B, rows):
            yield slice(b, b + rows), slice(0, T)
    else:
        for b in range(B):
            for s in range(0, T, chunk):
                yield slice(b, b + 1), slice(s, s + chunk)


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    x = x.float()
    return x / temperature if temperature != 1.0 else x  # x / 1.0 is x, bit for bit: no copy


class _SelectedLogprobs(torch.autograd.Function):
    """``log_softmax(logits / T)`` at the chosen tokens, a block of about ``chunk`` positions at a
    time.

    Autograd's ``log_softmax(...).gather(...)`` keeps the whole (B, T, V) log-softmax in fp32
    for its backward, and an entropy its exponential too: with a 150k vocabulary that is most of
    an update's memory. Here forward keeps only the logits (the model's output, alive anyway) and
    backward recomputes each block's log-softmax and calls the same backward kernel autograd
    calls, so values and gradients are the same bits as the whole-batch expression (tested)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, temperature: float, chunk: int,
                with_entropy: bool = False):
        out = torch.empty(index.shape, dtype=torch.float32, device=logits.device)
        # the entropy from the same log-softmax (one vocabulary-wide pass per block, not two)
        ent = torch.empty(index.shape if with_entropy else (0,), dtype=torch.float32, device=logits.device)
        for rs, ps in _blocks(logits.shape, chunk):
            ls = torch.log_softmax(_scaled(logits[rs, ps], temperature), dim=-1)
            out[rs, ps] = ls.gather(-1, index[rs, ps, None]).squeeze(-1)
            if with_entropy:
                ent[rs, ps] = -(ls.exp() * ls).sum(-1)
            del ls
        ctx.save_for_backward(logits, index)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_ent: torch.Tensor | None = None):
        logits, index = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for rs, ps in _blocks(logits.shape, chunk):
            ls = torch.log_softmax(_scaled(logits[rs, ps], temperature), dim=-1)
            go = torch.zeros_like(ls).scatter_(-1, index[rs, ps, None], grad_out[rs, ps, None])
            gi = torch._log_softmax_backward_data(go, ls, -1, torch.float32)
            del go, ls
            grad[rs, ps] = (gi / temperature if temperature != 1.0 else gi).to(logits.dtype)
        return grad, None, None, None, None


def selected_logprobs(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0,
                      chunk: int = LOGPROB_CHUNK, with_entropy: bool = False):
    """(B, T) log-probs of ``index`` under ``softmax(logits / temperature)`` for (B, T, V) logits,
    in fp32, differentiable, never holding more than about ``chunk`` positions' log-softmax.
    ``with_entropy``: also the (B, T) entropy of the same distribution (no gradient: it is a
    figure), from the same pass over the vocabulary."""
    logp, ent = _SelectedLogprobs.apply(logits, index, float(temperature), int(chunk), with_entropy)
    return (logp, ent) if with_entropy else logp


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False, span: int | None = None,
                   chunk: int = LOGPROB_CHUNK):
    """Log-prob of each next token under ``model`` at ``temperature``: shape (B, L-1).

    With ``with_entropy`` also returns the per-position entropy of the same distribution (no
    gradient). ``span``: score only the last ``span`` positions (the responses of a :func:`pack`
    batch, see :func:`response_span`); the others come back as 0. The language-model head then
    projects ``span`` positions instead of L: with a real vocabulary (49k-150k) the
    full-sequence logits are most of an update's memory. The log-probs are the same bits either
    way; gradients agree to float rounding (the head's weight gradient sums over fewer rows).
    The vocabulary-wide softmax runs ``chunk`` positions at a time (:func:`selected_logprobs`):
    no full-vocabulary log-prob tensor is kept, and the values are the same bits.
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
    logits = out.logits[:, -(keep + 1):-1]
    logp, entropy = (selected_logprobs(logits, input_ids[:, L - keep:], temperature, chunk, True) if with_entropy
                     else (selected_logprobs(logits, input_ids[:, L - keep:], temperature, chunk), None))
    if keep < L - 1:  # the prompt positions nobody scores
        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.new_zeros(x.shape[0], L - 1 - keep), x], dim=1)
        logp = pad(logp)
        entropy = pad(entropy) if entropy is not None else None
    if not with_entropy:
        return logp.to(where)
    return logp.to(where), entropy.to(where)


def shared_prefix_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int, width: int,
                           temperature: float = 1.0, with_entropy: bool = False, chunk: int = LOGPROB_CHUNK):
    """:func:`token_logprobs` of a :func:`pack` batch (``width`` = its L), each distinct prompt
    run once: its rows (a prompt's G samples, and a sharing learner's peer responses rendered in
    its own template) take its keys and values from one prefill.

    The prompts but their last token run left-padded with the cache on; each row's cache is its
    prompt's (a gather, through which the gradients flow back into the one prompt forward); each
    row then runs its prompt's last token and its response but the last, right-padded, positions
    continuing the prompt's, so that position j's logits score response token j (no copy of a
    batch x length x vocabulary tensor to line them up), and the language-model head projects the
    response tokens only, not the padding of the shorter ones. The result is laid
    out as :func:`pack`'s: (B, width-1), each response in the last positions of its row, 0
    elsewhere. The same distributions as the whole-sequence forward, to float rounding (other
    matrix shapes): with G samples per prompt the prompt's share of the forward falls G-fold.
    """
    where = torch.device("cpu")
    dev = next(model.parameters()).device
    keys = {tuple(p): i for i, p in enumerate(dict.fromkeys(tuple(p) for p in prompts))}
    if min(len(p) for p in keys) < 2:  # a one-token prompt leaves nothing to cache before its last token
        ids, attn, resp = pack(prompts, responses, pad_id)
        out = token_logprobs(model, ids, attn, temperature, with_entropy, span=response_span(resp), chunk=chunk)
        off = resp == 0  # 0 outside the responses, as below
        return tuple(x.masked_fill(off, 0.0) for x in out) if with_entropy else out.masked_fill(off, 0.0)
    unique = [list(p)[:-1] for p in keys]
    group = torch.tensor([keys[tuple(p)] for p in prompts], dtype=torch.long, device=dev)
    lp_len = max(len(p) for p in unique)
    p_ids = torch.tensor([[pad_id] * (lp_len - len(p)) + p for p in unique], dtype=torch.long, device=dev)
    p_attn = torch.tensor([[0] * (lp_len - len(p)) + [1] * len(p) for p in unique], dtype=torch.long, device=dev)
    pre = model(input_ids=p_ids, attention_mask=p_attn, position_ids=position_ids_from_mask(p_attn), use_cache=True,
                logits_to_keep=1)
    cache = pre.past_key_values
    cache.batch_select_indices(group)
    r_len = max(1, max(len(r) for r in responses))
    r_ids = torch.tensor([r + [pad_id] * (r_len - len(r)) for r in responses], dtype=torch.long, device=dev)
    x_ids = torch.tensor([([p[-1], *r[:-1]] if r else []) + [pad_id] * (r_len - len(r))
                          for p, r in zip(prompts, responses)], dtype=torch.long, device=dev)
    x_attn = torch.tensor([[1] * len(r) + [0] * (r_len - len(r)) for r in responses], dtype=torch.long, device=dev)
    start = p_attn.sum(1)[group]  # each row's last prompt position
    valid = x_attn.bool()

    def response_rows_only(_head, args):
        # the head projects the response tokens alone, as one row (B x length -> 1 x tokens): no
        # vocabulary-wide logits, softmax or gradient for the padding of shorter responses
        return (args[0][valid].unsqueeze(0), *args[1:])

    head = getattr(model, "module", model).get_output_embeddings().register_forward_pre_hook(response_rows_only)
    try:
        logits = model(input_ids=x_ids, attention_mask=torch.cat([p_attn[group], x_attn], dim=1),
                       position_ids=start[:, None] + torch.arange(r_len, device=dev)[None, :], use_cache=False,
                       cache=cache).logits
    finally:
        head.remove()
    chosen = r_ids[valid].unsqueeze(0)
    lp, ent = selected_logprobs(logits, chosen, temperature, chunk, True) if with_entropy else \
        (selected_logprobs(logits, chosen, temperature, chunk), None)
    # into pack's layout: row i's response in its last len(r_i) positions of (B, width - 1)
    B = len(responses)
    rows = torch.tensor([i for i, r in enumerate(responses) for _ in r], dtype=torch.long, device=dev)
    dst = torch.tensor([width - 1 - len(r) + j for r in responses for j in range(len(r))], dtype=torch.long, device=dev)

    def place(x: torch.Tensor) -> torch.Tensor:  # x: (1, tokens) in row-major order of the responses
        return x.new_zeros(B, width - 1).index_put((rows, dst), x[0]).to(where)

    return (place(lp), place(ent)) if with_entropy else place(lp)
