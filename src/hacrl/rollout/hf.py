"""transformers ``generate`` as a rollout engine, in the stage's own process.

The ``hf`` row of the engine table (:mod:`hacrl.rollout.table`): it wraps the model the stage
loaded (and placed on the job's device), so it needs no process of its own and its log-probs are
the trainer's own forward's, bit for bit.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from hacrl.errors import DataError
from hacrl.rollout.engine import Completion, EngineRequest, SamplingParams

log = logging.getLogger(__name__)


class _StepLogprobs:
    """The sampled tokens' log-probs at the sampling temperature, one decoding step at a time.

    A forward hook on the model: each forward of ``generate`` yields the next position's raw
    logits; the hook keeps that step's log-softmax (of ``logits / temperature``; top-p is not
    folded in) until the next forward, whose input is the token sampled from it, and keeps only
    that token's log-prob. So at most one ``batch x vocabulary`` distribution is alive, where
    ``output_logits=True`` kept one per step (``batch x steps x vocabulary``: 600 MB for 64
    sequences of 48 tokens with a 49k vocabulary, copied three times over). Same values, bit for
    bit: the log-softmax of each row is computed the same way one step or all steps at a time.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev: torch.Tensor | None = None
        self.out: list[torch.Tensor] = []

    def __call__(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.prev is not None:  # this forward's input ends with the token sampled from prev
            self.out.append(self._take(ids[:, -1]))
        logits = output.logits if hasattr(output, "logits") else output[0]
        # as generate takes them: the last position, in float32
        self.prev = torch.log_softmax(logits[:, -1, :].float() / self.temperature, dim=-1)

    def _take(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.prev.gather(-1, tokens.to(self.prev.device)[:, None]).squeeze(-1).cpu()

    def finish(self, last_tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """``batch x steps`` log-probs, given the tokens of the last step."""
        if self.prev is not None:
            self.out.append(self._take(last_tokens))
            self.prev = None
        if len(self.out) != steps:
            raise RuntimeError(f"generate made {steps} steps but the model ran {len(self.out)} forwards")
        return torch.stack(self.out, dim=1)


class InverseCDFSampler:
    """A transformers logits processor that draws the next token itself, so ``generate`` can run
    greedy (argmax of the one-hot it returns) and skip ``torch.multinomial``.

    ``softmax(logits / temperature)``, cut to the nucleus ``top_p`` (the smallest set of most
    likely tokens whose mass reaches it, renormalised: what transformers' ``TopPLogitsWarper``
    keeps), then one uniform variate per row from the global generator against the cumulative
    sum. The same distribution as ``do_sample=True``; one random number per row where
    multinomial draws one per vocabulary entry."""

    def __init__(self, temperature: float, top_p: float = 1.0):
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            # keep a token while the mass before it is under top_p (the most likely one always)
            cut = (sp.cumsum(-1) - sp) >= self.top_p
            probs = torch.zeros_like(probs).scatter_(-1, si, sp.masked_fill(cut, 0.0))
        cdf = probs.cumsum(-1)
        u = torch.rand(probs.shape[0], 1, device=probs.device) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, token, 0.0)


class HFEngine:
    """transformers ``generate`` (batched, KV cache) over a loaded model and tokenizer."""

    hosted = False  # no process of its own, nothing for the engine host to keep

    def __init__(self, model, tokenizer, batch_size: int = 512, desc: str = "generate", max_batch_tokens: int = 0):
        self.cost: dict[str, float] = {}
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.desc = desc
        self.max_batch_tokens = int(max_batch_tokens)
        """KV-cache budget of one ``generate`` call: rows x (longest prompt + new tokens); 0: none."""

    @classmethod
    def open(cls, request: EngineRequest) -> HFEngine:
        """Over ``request.model`` (loaded by the stage, on the job's device)."""
        return cls(request.model, request.tokenizer, request.batch_size, desc=request.desc,
                   max_batch_tokens=request.max_batch_tokens)

    def batches(self, lengths: list[int], max_new_tokens: int) -> list[list[int]]:
        """Positions of ``lengths`` (prompt lengths, ascending) per ``generate`` call: at most
        ``batch_size`` rows, and within ``max_batch_tokens`` KV-cache tokens (a row over it alone)."""
        if self.max_batch_tokens <= 0:
            return [list(range(b0, min(b0 + self.batch_size, len(lengths))))
                    for b0 in range(0, len(lengths), self.batch_size)]
        out: list[list[int]] = []
        cur: list[int] = []
        for i, n in enumerate(lengths):
            if cur and (len(cur) + 1 > self.batch_size or (len(cur) + 1) * (n + max_new_tokens) > self.max_batch_tokens):
                out.append(cur)
                cur = []
            cur.append(i)
        return out + ([cur] if cur else [])

    def load_weights(self, weights_dir) -> dict:
        """Serve the weights of ``weights_dir`` (same architecture), copied into the model in place."""
        import time

        from transformers import AutoModelForCausalLM

        t0 = time.time()
        dtype = next(self.model.parameters()).dtype
        fresh = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype)
        self.model.load_state_dict(fresh.state_dict())
        return {"mode": "in_place", "seconds": time.time() - t0}

    def release(self, action: str) -> None:
        """Nothing to free: the model belongs to the stage (it leaves the device with the stage)."""

    def close(self) -> None:
        """Nothing to stop: the model belongs to the stage."""

    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        tok = self.tokenizer
        enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        _check_positions(self.model.config, max((len(e) for e in enc), default=0), params.max_new_tokens, self.desc)
        jobs = [(i, s) for i in range(len(prompts)) for s in range(params.n)]
        # sort by prompt length so a batch pads little; results come back in job order
        order = sorted(range(len(jobs)), key=lambda j: len(enc[jobs[j][0]]))
        results: list[Completion | None] = [None] * len(jobs)
        gen = torch.Generator().manual_seed(params.seed)
        eos = tok.eos_token_id
        pad = tok.pad_token_id
        self.model.eval()
        calls = self.batches([len(enc[jobs[j][0]]) for j in order], params.max_new_tokens)
        for call in tqdm(calls, desc=self.desc, leave=False, disable=len(calls) <= 1):
            idx = [order[k] for k in call]
            batch_prompts = [enc[jobs[j][0]] for j in idx]
            L = max(len(p) for p in batch_prompts)
            # left padding, built as lists and converted once (a tensor per row cost 10 us each)
            input_ids = torch.tensor([[pad] * (L - len(p)) + p for p in batch_prompts], dtype=torch.long)
            attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch_prompts], dtype=torch.long)
            # a per-batch seed drawn from the stage's generator: reproducible for a given batching
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            if params.greedy:
                kw = dict(do_sample=False)
            elif params.sampler == "inverse_cdf":  # greedy over the processor's one-hot draw
                from transformers import LogitsProcessorList

                kw = dict(do_sample=False, logits_processor=LogitsProcessorList(
                    [InverseCDFSampler(params.temperature, params.top_p)]))
            else:
                kw = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
            if params.stop:  # a finished row samples on (the random stream is unchanged) but its tokens are pad
                kw.update(stop_strings=list(params.stop), tokenizer=tok)
            dev = next(self.model.parameters()).device  # a GPU when the job was placed on one
            steps = _StepLogprobs(1.0 if params.greedy else params.temperature)
            hook = self.model.register_forward_hook(steps, with_kwargs=True)
            try:
                seqs = self.model.generate(input_ids=input_ids.to(dev), attention_mask=attn.to(dev),
                                           max_new_tokens=params.max_new_tokens, pad_token_id=pad,
                                           eos_token_id=eos, **kw)
            finally:
                hook.remove()
            new = seqs[:, L:].cpu()
            lps = steps.finish(seqs[:, -1], new.shape[1]).tolist()  # lists once, not per row
            rows = []
            for ids in new.tolist():
                if eos in ids:
                    rows.append((ids[: ids.index(eos) + 1], "stop"))
                else:
                    rows.append((ids, "length"))
            texts = tok.batch_decode([ids for ids, _ in rows], skip_special_tokens=True)
            for r, j in enumerate(idx):
                (ids, finish), pi, si = rows[r], *jobs[j]
                results[j] = Completion(pi, si, texts[r], batch_prompts[r], ids, lps[r][: len(ids)], finish)
        return results  # type: ignore[return-value]


def _check_positions(config, longest_prompt: int, max_new_tokens: int, desc: str) -> None:
    """A model with a fixed table of learned positions (GPT-2's ``n_positions``) fails deep inside
    torch ("index out of range in self") once a row outgrows it: refuse before generating, as vLLM
    refuses a prompt + max_tokens over its max_model_len. Rotary models extrapolate and are let be."""
    limit = getattr(config, "n_positions", None)
    if limit and longest_prompt + max_new_tokens > limit:
        raise DataError(f"{desc}: a prompt of {longest_prompt} tokens + max_new_tokens {max_new_tokens} = "
                         f"{longest_prompt + max_new_tokens} positions, over the model's {limit} (n_positions, "
                         "learned positions); lower rollout.max_new_tokens / eval.max_new_tokens or use a model "
                         "with a longer context")
