"""Rollout engines: the interface every generator implements, and its transformers version.

An engine turns rendered prompts into completions carrying what later stages need: text,
the generating model's token ids, their log-probs at the sampling temperature, and the
finish reason. The vLLM engine (a later issue) implements the same interface.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False
    seed: int = 0


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop" (EOS) or "length"


class RolloutEngine(Protocol):
    """What generate-rollouts and evaluate need from a generator."""

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        """Return ``len(prompts) * params.n`` completions, prompt-major."""
        ...


class HFEngine:
    """transformers ``generate`` (batched, KV cache) over a loaded model and tokenizer."""

    def __init__(self, model, tokenizer, batch_size: int = 512, desc: str = "generate"):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.desc = desc

    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        tok = self.tokenizer
        enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        jobs = [(i, s) for i in range(len(prompts)) for s in range(params.n)]
        # sort by prompt length so a batch pads little; results come back in job order
        order = sorted(range(len(jobs)), key=lambda j: len(enc[jobs[j][0]]))
        results: list[Completion | None] = [None] * len(jobs)
        gen = torch.Generator().manual_seed(params.seed)
        eos = tok.eos_token_id
        pad = tok.pad_token_id
        self.model.eval()
        for b0 in tqdm(range(0, len(order), self.batch_size), desc=self.desc, leave=False,
                       disable=len(order) <= self.batch_size):
            idx = order[b0:b0 + self.batch_size]
            batch_prompts = [enc[jobs[j][0]] for j in idx]
            L = max(len(p) for p in batch_prompts)
            input_ids = torch.full((len(idx), L), pad, dtype=torch.long)
            attn = torch.zeros_like(input_ids)
            for r, p in enumerate(batch_prompts):
                input_ids[r, L - len(p):] = torch.tensor(p)
                attn[r, L - len(p):] = 1
            # a per-batch seed drawn from the stage's generator: reproducible for a given batching
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            kw = dict(do_sample=False) if params.greedy else dict(
                do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
            dev = next(self.model.parameters()).device  # a GPU when the job was placed on one
            out = self.model.generate(input_ids=input_ids.to(dev), attention_mask=attn.to(dev),
                                      max_new_tokens=params.max_new_tokens, pad_token_id=pad,
                                      eos_token_id=eos, output_logits=True,
                                      return_dict_in_generate=True, **kw)
            new = out.sequences[:, L:].cpu()
            # raw logits -> the sampling distribution at the temperature (top-p is not folded in)
            temp = 1.0 if params.greedy else params.temperature
            logits = torch.stack(out.logits, dim=1).float().cpu() / temp
            lp = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)
            for r, j in enumerate(idx):
                ids = new[r].tolist()
                finish = "length"
                if eos in ids:
                    ids = ids[: ids.index(eos) + 1]
                    finish = "stop"
                text = tok.decode(ids, skip_special_tokens=True)
                pi, si = jobs[j]
                results[j] = Completion(pi, si, text, batch_prompts[r], ids,
                                        lp[r, : len(ids)].tolist(), finish)
        return results  # type: ignore[return-value]
