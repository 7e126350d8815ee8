"""``update_smollm2``: the policy update on SmolLM2-135M-Instruct with 512-token responses, the stage
against TRL's ``GRPOTrainer`` at the same micro-batch budget.

The work: SmolLM2's iteration-1 training input (``agents=smollm2_mix experiment=smollm2``, GRPO)
with every response replaced, once and untimed, by a 512-token continuation the model samples from
the row's prompt (end-of-sequence suppressed), and the rewards set to 1, 0, 1, 0 within each group:
every sample carries gradient, so neither side may skip a backward. Both sides: the same mini-batches,
4 samples per forward (``trainer.micro_batch_samples=4``; TRL's ``per_device_train_batch_size=4``
with gradient accumulation over the mini-batch), no gradient checkpointing, fp32, GRPO's clipped
loss without KL, old log-probs recomputed by a no-grad pass, AdamW, gradient clipping.

Contenders: ``stage`` (:func:`hacrl.rl.step.train_learner` as update-policies runs it) and ``trl``
(``GRPOTrainer.train()`` with its generation replaced by the same batch: see
:mod:`hacrl.study.bench.update`). Goals: ``stage`` >= 1.3x TRL's samples per second, at a peak RSS
no higher than TRL's. Only where TRL is installed (``make setup-bench``). Units: samples.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hacrl.study.bench.core import Contender, Goal, SuiteResult, compare
from hacrl.study.bench.update import _load, _ours, _prepare_iteration, _trl, _trl_setup
from hacrl.study.bench.workspace import workspace

log = logging.getLogger(__name__)
DEFAULT_REPS = 1
AGENT = "smollm2-135m"
MODEL_DIR = Path("models") / "SmolLM2-135M-Instruct"
MICRO = 4
RESPONSE_TOKENS = {"full": 512, "smoke": 16}
OVERRIDES = {
    "full": ["agents=smollm2_mix", "experiment=smollm2", "agents.pool.1.warmup.max_steps=0", "data.train_size=400",
             "data.heldout_size=8", "data.dev_size=8", "rollout.prompts_per_iteration=4",
             "trainer.mini_batch_prompts=2", "trainer.micro_batch_tokens=0", f"trainer.micro_batch_samples={MICRO}",
             "trainer.gradient_checkpointing=false"],
    "smoke": ["agents=smollm2_mix", "experiment=smollm2", "agents.pool.1.warmup.max_steps=0", "data.train_size=100",
              "data.heldout_size=4", "data.dev_size=4", "rollout.prompts_per_iteration=2", "rollout.group_size=4",
              "rollout.max_new_tokens=8", "trainer.mini_batch_prompts=1", "trainer.micro_batch_tokens=0",
              f"trainer.micro_batch_samples={MICRO}", "trainer.gradient_checkpointing=false"],
}


def stretch_responses(cfg, name: str, t: int, n_tokens: int) -> int:
    """Replace every response of ``name``'s training input with an ``n_tokens`` sample of the
    model from the row's prompt, rewards alternating within each group; returns the rows."""
    import torch

    from hacrl.agents.scoring import pack, response_span, token_logprobs
    from hacrl.exchange.experience import read_records, write_records

    path = cfg.layout.learner_input(t, name)
    df = read_records(path, "learner_input")
    agent = _load(cfg, name, t)
    tok, model = agent.tokenizer, agent.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = [list(p) for p in df["input_prompt_ids"]]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, min_new_tokens=n_tokens,
                             max_new_tokens=n_tokens, pad_token_id=pad)
        responses = [r.tolist() for r in out[:, width:]]
        packed = pack(prompts, responses, pad)
        lp = token_logprobs(model, packed[0], packed[1], span=response_span(packed[2]))
    lps = [row[-n_tokens:].tolist() for row in lp]
    df = df.copy()
    df["input_response_ids"] = responses
    df["response_token_ids"] = responses
    df["response_text"] = tok.batch_decode(responses)
    for col in ("response_logprobs", "old_logprobs", "behavior_logprobs_aligned"):
        df[col] = lps
    df["behavior_logprob_mean"] = [sum(x) / len(x) for x in lps]
    rank = df.groupby("prompt_id").cumcount()
    df["reward"] = (rank % 2 == 0).astype(float)
    df["verdict"] = ["correct" if r else "wrong" for r in df["reward"]]
    df["finish_reason"] = "length"
    write_records(path, df, "learner_input")
    return len(df)


def run(size: str, reps: int, work_dir: Path, project: Path = Path(".")) -> SuiteResult:
    import importlib.util

    mine = project.resolve() / MODEL_DIR
    if (mine / "config.json").exists():  # the project's converted model: no second fetch
        (work_dir / MODEL_DIR).parent.mkdir(parents=True, exist_ok=True)
        if not (work_dir / MODEL_DIR).exists():
            os.symlink(mine, work_dir / MODEL_DIR, target_is_directory=True)
    have_trl = importlib.util.find_spec("trl") is not None
    with workspace(size, work_dir, project, tuple(OVERRIDES[size])) as cfg:
        t = 1
        _prepare_iteration(cfg, t)
        n = stretch_responses(cfg, AGENT, t, RESPONSE_TOKENS[size])
        contenders = [Contender("stage", lambda ag: _ours(ag, cfg, AGENT, t, work_dir / "state"),
                                f"train_learner, DeepSpeed engine, {MICRO} samples per forward",
                                setup=lambda: _load(cfg, AGENT, t))]
        if have_trl:
            contenders.append(Contender("trl", _trl, f"TRL GRPOTrainer.train(), {MICRO} samples per forward, "
                                        "gradient accumulation over the mini-batch",
                                        setup=lambda: _trl_setup(cfg, AGENT, t, work_dir / "trl", micro=MICRO)))
        measured = compare(contenders, reps)
        work = {"learner": f"{AGENT} ({cfg.agent(AGENT).path})", "samples": n,
                "response_tokens": RESPONSE_TOKENS[size], "samples_per_forward": MICRO,
                "prompts": cfg.rollout.prompts_per_iteration, "samples_per_prompt": cfg.samples_per_prompt,
                "mini_batch_prompts": cfg.trainer.mini_batch_prompts, "algorithm": cfg.algorithm.name,
                "dtype": cfg.trainer.dtype, "threads": cfg.experiment.threads}
        goals, notes = [], []
        if have_trl:
            import trl

            work["trl"] = trl.__version__
            goals = [Goal("stage", "trl", 1.3), Goal("stage", "trl", 1.0, "growth")]
        else:
            notes.append("TRL is not installed (make setup-bench): the stage only")
    return SuiteResult("update_smollm2", "samples", work, measured, goals, notes, baseline="trl" if have_trl else None)
