"""``rollout``: the generate-rollouts stage against a bare transformers ``generate`` loop.

Same models, prompts, sampling settings, batches and per-batch seeds, so both produce the same
tokens (checked: the token counts must match). The stage also returns log-probs (generate's
logits, softmaxed step by step), writes the Parquet shard of records (and, if
``engines.logprob_check_samples`` is set, checks its log-probs against the trainer's forward);
the bare loop generates and decodes. Both load each agent's checkpoint, as a user's script would. Units: generated tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hacrl.study.bench.core import Contender, Goal, SuiteResult, compare
from hacrl.study.bench.workspace import workspace

log = logging.getLogger(__name__)
DEFAULT_REPS = 3


def bare_generate(cfg, t: int = 1) -> int:
    """What a user would write: load, tokenize, left-pad, ``generate``, decode each completion up
    to its EOS; count the new tokens."""
    import torch

    from hacrl.agents.pool import load_agent
    from hacrl.seeds import hash_seed
    from hacrl.storage import RunLayout
    from hacrl.task import data as task_data
    from hacrl.task.data import read_split

    r = cfg.rollout
    prompts = task_data.prompts_for_iteration(read_split(cfg.layout.tasks, "train"), r.prompts_per_iteration, cfg.experiment.seed, t)
    total = 0
    for ac in cfg.agents:
        agent = load_agent(ac, RunLayout(cfg.experiment.runs_dir).checkpoint(t - 1, ac.name), cfg.trainer.dtype)
        tok, model = agent.tokenizer, agent.model
        enc = [tok(agent.render(p["problem"]), add_special_tokens=False)["input_ids"] for p in prompts]
        jobs = [i for i in range(len(enc)) for _ in range(cfg.samples_per_prompt)]
        # the stage's batching and seeds (sorted by prompt length, a seed per batch), so the same tokens
        order = sorted(range(len(jobs)), key=lambda j: len(enc[jobs[j]]))
        gen = torch.Generator().manual_seed(hash_seed(cfg.experiment.seed, "rollout", t, ac.name))
        with torch.no_grad():
            for b0 in range(0, len(order), r.batch_size):
                batch = [enc[jobs[j]] for j in order[b0:b0 + r.batch_size]]
                L = max(map(len, batch))
                ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in batch])
                attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=r.max_new_tokens,
                                     do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=0,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                for row in out[:, L:].tolist():  # up to EOS, decoded: the text a reward needs
                    ids = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
                    tok.decode(ids, skip_special_tokens=True)
                    total += len(ids)
    return total


def run(size: str, reps: int, work_dir: Path) -> SuiteResult:
    from hacrl.pipeline import table

    with workspace(size, work_dir) as cfg:
        t = 1

        def stage() -> dict:
            res = table.run("generate-rollouts", cfg, t)
            out = {"units": sum(v["tokens"] for v in res.values())}
            if cfg.engines.logprob_check_samples:
                out["logprob_gap_max"] = max(v.get("logprob_gap_max", 0.0) for v in res.values())
            return out

        measured = compare([Contender("stage", stage, "generate-rollouts: records, log-probs, shard, log-prob check"),
                            Contender("bare_generate", lambda: bare_generate(cfg, t),
                                      "transformers generate, same batches and seeds")], reps)
        same = measured["stage"].units == measured["bare_generate"].units
        work = {"agents": ", ".join(f"{a.name} ({a.arch})" for a in cfg.agents),
                "prompts": cfg.rollout.prompts_per_iteration, "samples_per_prompt": cfg.samples_per_prompt,
                "max_new_tokens": cfg.rollout.max_new_tokens, "batch_size": cfg.rollout.batch_size,
                "engine": cfg.rollout.engine, "same_tokens": same}
        notes = [] if same else ["the two contenders generated different token counts: check the seeding"]
    return SuiteResult("rollout", "tokens", work, measured, [Goal("stage", "bare_generate", 0.95)], notes)
