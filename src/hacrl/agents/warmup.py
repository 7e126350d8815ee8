"""Supervised warm-up: gives each embedded agent its starting competence.

Each agent trains on the task's train split until its dev accuracy reaches its own target
(weak / middling / strong) or its step budget runs out. Dev problems are disjoint from both
train and held-out problems, so the stopping rule never looks at the evaluation set.
"""

from __future__ import annotations

import logging
import random
import time

import torch
from tqdm.auto import tqdm

from hacrl.agents.pool import Agent
from hacrl.agents.scoring import pack, token_logprobs
from hacrl.config.schema import WarmupConfig
from hacrl.rollout.engine import SamplingParams, cut_at_stop
from hacrl.rollout.hf import HFEngine
from hacrl.task.data import target_text
from hacrl.task.rewards import CORRECT, VerifierPool

log = logging.getLogger(__name__)


def greedy_answers(agent: Agent, problems: list[dict], max_new_tokens: int,
                   batch_size: int = 600, max_batch_tokens: int = 0) -> list[tuple[str, str]]:
    """Greedy completions through the rollout engine, as (gold, answer) pairs for the verifier
    (``max_batch_tokens``: the KV-cache budget of one generate call, 0: none)."""
    engine = HFEngine(agent.model, agent.tokenizer, batch_size=batch_size, desc=f"eval {agent.name}",
                      max_batch_tokens=max_batch_tokens)
    comps = cut_at_stop(engine.generate([agent.render(p["problem"]) for p in problems],
                                        SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens,
                                                       stop=agent.stop)),
                        agent.tokenizer, agent.stop)
    return [(p["answer"], c.text) for p, c in zip(problems, comps)]


def accuracy(verdicts: list[str]) -> float:
    return sum(v == CORRECT for v in verdicts) / max(1, len(verdicts))


def greedy_accuracy(agent: Agent, problems: list[dict], verifier: VerifierPool,
                    max_new_tokens: int, batch_size: int = 600) -> tuple[float, list[str]]:
    """Greedy pass@1 through the rollout engine and the verifier; returns (acc, verdicts)."""
    verdicts = verifier.verify(greedy_answers(agent, problems, max_new_tokens, batch_size),
                               desc=f"verify {agent.name}")
    return accuracy(verdicts), verdicts


def warm_up(agent: Agent, cfg: WarmupConfig, train: list[dict], dev: list[dict],
            verifier: VerifierPool, seed: int, max_new_tokens: int, completion: str = "answer") -> dict:
    """Train ``agent`` in place; return its warm-up record (steps, dev curve, seconds).
    ``completion``: what the targets hold after the prompt (``data.completion``)."""
    tok = agent.tokenizer
    prompts = tok([agent.render(p["problem"]) for p in train], add_special_tokens=False)["input_ids"]
    targets = tok([target_text(p, completion) for p in train], add_special_tokens=False)["input_ids"]
    targets = [t + [tok.eos_token_id] for t in targets]
    rng = random.Random(f"{seed}/warmup/{agent.name}")
    torch.manual_seed(rng.randrange(2**31))
    opt = torch.optim.AdamW(agent.model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    curve: list[tuple[int, float]] = []
    t0 = time.time()
    step = 0
    acc = 0.0
    bar = tqdm(total=cfg.max_steps, desc=f"warm-up {agent.name}", leave=False)
    while step < cfg.max_steps:
        agent.model.train()
        idx = [rng.randrange(len(train)) for _ in range(cfg.batch_size)]
        ids, attn, resp = pack([prompts[i] for i in idx], [targets[i] for i in idx], tok.pad_token_id)
        for g in opt.param_groups:  # linear ramp, then constant
            g["lr"] = cfg.lr * min(1.0, (step + 1) / 100)
        logp = token_logprobs(agent.model, ids, attn)
        loss = -(logp * resp).sum() / resp.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agent.model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update()
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            agent.model.eval()
            acc, _ = greedy_accuracy(agent, dev, verifier, max_new_tokens)
            curve.append((step, acc))
            bar.set_postfix(loss=f"{loss.item():.3f}", dev=f"{acc:.3f}")
            if acc >= cfg.target_accuracy and step >= cfg.min_steps:
                break
    bar.close()
    agent.model.eval()
    secs = time.time() - t0
    log.info("warm-up %s: %d steps, dev accuracy %.3f (target %.2f), %.0fs",
             agent.name, step, acc, cfg.target_accuracy, secs)
    return {"steps": step, "dev_accuracy": acc, "target": cfg.target_accuracy,
            "curve": curve, "seconds": round(secs, 1)}
