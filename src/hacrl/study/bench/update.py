"""``update``: one learner's policy update against TRL's ``GRPOTrainer`` on the same batch.

The work: one learner (the pool's last, its largest) and its iteration-1 training input
(``learner_input``: the rows the update-policies stage trains on), cut into the stage's
mini-batches; one optimizer step per mini-batch, GRPO loss (per-token ratio clipped to
[1-0.2, 1+0.28], mean over each response's tokens, then over responses), no KL term, AdamW,
gradient clipping 1.0. Each round loads the agent's checkpoint afresh, untimed, on both sides;
the timed region is the update itself: building the optimizer (the DeepSpeed engine, TRL's
accelerator and Trainer state inside ``train()``), the old log-probs, the steps. Neither side
writes a model checkpoint; the stage writes its recovery state (optimizer moments included): that
is part of its work.

Contenders:

- ``stage``: :func:`hacrl.rl.step.train_learner` as update-policies runs it (DeepSpeed engine on
  the CPU accelerator), default config: the old log-probs recomputed (verl's behaviour).
- ``stage_gen_logprobs``: the same with ``trainer.recompute_old_logprobs=false``: own samples
  of the transformers engine keep their generation log-probs, so no no-grad pass.
- ``trl``: TRL's ``GRPOTrainer.train()`` (``loss_type="grpo"``, ``beta=0``,
  ``epsilon=0.2``, ``epsilon_high=0.28``, ``per_device_train_batch_size`` = one mini-batch,
  ``steps_per_generation`` = the number of mini-batches, ``max_steps`` = the same). Its
  generation is replaced, not timed away: ``_generate_and_score_completions`` returns the same
  prompts, completions and advantages the stage trains on, and computes TRL's old log-probs with
  TRL's own no-grad pass exactly when TRL would (several optimizer steps per generation batch:
  it does). Only when ``trl`` is installed (``make setup-bench``; not a runtime dependency).

Units: samples.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

from hacrl.study.bench.core import Contender, Goal, SuiteResult, compare
from hacrl.study.bench.workspace import workspace

log = logging.getLogger(__name__)
DEFAULT_REPS = 3


def _prepare_iteration(cfg, t: int = 1) -> None:
    """Rollouts, rewards, exchange and capability stats of iteration t (not timed)."""
    from hacrl.pipeline.in_process import run_iteration_until

    run_iteration_until(cfg, t, "update-policies")


def _load(cfg, name: str, t: int):
    from hacrl.agents.pool import load_agent

    return load_agent(cfg.agent(name), cfg.layout.checkpoint(t - 1, name), cfg.trainer.dtype)


def _ours(agent, cfg, name: str, t: int, state_dir: Path) -> dict:
    from hacrl.exchange.experience import read_records
    from hacrl.rl.step import train_learner
    from hacrl.seeds import hash_seed
    from hacrl.storage import read_json

    lay = cfg.layout
    batch = read_records(lay.learner_input(t, name), "learner_input")
    stats = train_learner(agent, batch, cfg, seed=hash_seed(cfg.experiment.seed, "update", t, name),
                          prev_state=lay.train_state(t - 1) / name, out_state=state_dir,
                          omega=read_json(lay.capability(t))["omega"])
    return {"units": stats["samples"], "old_logprobs_recomputed": stats["old_logprobs_recomputed"],
            "gen_vs_train_logprob_maxdiff": round(stats["gen_vs_train_logprob_maxdiff"], 7),
            "updates": stats["updates"]}


def _trl_inputs(cfg, name: str, t: int):
    """The stage's batch as TRL's tensors: left-padded prompts, right-padded completions, and
    the advantages the stage's estimator gives, in the stage's mini-batch count."""
    from hacrl.exchange.experience import read_records
    from hacrl.rl.algorithms import ADVANTAGES
    from hacrl.rl.layout import layout
    from hacrl.rl.step import advantage_inputs
    from hacrl.seeds import hash_seed
    from hacrl.storage import read_json

    lay = cfg.layout
    batch = read_records(lay.learner_input(t, name), "learner_input")
    adv = ADVANTAGES[cfg.algorithm.advantage.name].fn(
        advantage_inputs(batch, cfg, name, read_json(lay.capability(t))["omega"]), cfg.algorithm.advantage)
    mbs = layout(batch, cfg, name, hash_seed(cfg.experiment.seed, "update", t, name))
    prompts = [list(x) for x in batch["input_prompt_ids"]]
    comps = [list(x) for x in batch["input_response_ids"]]
    return prompts, comps, adv, len(mbs), max(len(m) for m in mbs)


def _trl_setup(cfg, name: str, t: int, out_dir: Path, micro: int | None = None):
    """A GRPOTrainer over a freshly loaded agent, its 'generation' handing back the stage's batch;
    ``micro``: samples per forward (gradient accumulation over the mini-batch; default: the whole
    mini-batch in one forward)."""
    import torch
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    prompts, comps, adv, n_mb, mb = _trl_inputs(cfg, name, t)
    n = n_mb * mb
    per_device = micro or mb
    if mb % per_device:
        raise ValueError(f"bench: {mb} samples per mini-batch do not split into forwards of {per_device}")
    gas = mb // per_device
    prompts, comps, adv = prompts[:n], comps[:n], adv[:n]  # equal mini-batches (TRL splits evenly)
    agent = _load(cfg, name, t)
    pad = agent.tokenizer.pad_token_id
    P, R = max(map(len, prompts)), max(map(len, comps))
    p_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    p_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    c_ids = torch.tensor([c + [pad] * (R - len(c)) for c in comps])
    c_mask = torch.tensor([[1] * len(c) + [0] * (R - len(c)) for c in comps])

    class FixedBatchGRPO(GRPOTrainer):
        """GRPOTrainer whose 'generation' hands back the stage's batch."""

        def _generate_and_score_completions(self, generation_batch):
            out = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids,
                   "completion_mask": c_mask, "advantages": adv.clone(),
                   "num_items_in_batch": c_mask.sum()}
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self.args.gradient_accumulation_steps % generate_every != 0:  # TRL's own condition
                with torch.no_grad():
                    old, _, _ = self._get_per_token_logps_and_entropies(
                        self.model, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), R,
                        batch_size=self.args.per_device_train_batch_size)
                out["old_per_token_logps"] = old
            return out

    tc = cfg.trainer
    args = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=per_device, gradient_accumulation_steps=gas,
                      steps_per_generation=n_mb * gas, num_generations=cfg.samples_per_prompt, max_steps=n_mb,
                      learning_rate=tc.lr, lr_scheduler_type="constant", warmup_steps=0,
                      adam_beta1=tc.adam_betas[0], adam_beta2=tc.adam_betas[1], weight_decay=tc.weight_decay,
                      max_grad_norm=tc.grad_clip, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="grpo",
                      max_completion_length=R, save_strategy="no", report_to="none", use_cpu=True,
                      logging_strategy="no", log_level="error", disable_tqdm=True, dataloader_num_workers=0,
                      seed=cfg.experiment.seed, bf16=False, fp16=False, gradient_checkpointing=False)
    ds = Dataset.from_dict({"prompt": ["unused"] * n})
    trainer = FixedBatchGRPO(model=agent.model, reward_funcs=lambda **kw: [0.0] * len(kw["prompts"]),
                             args=args, train_dataset=ds, processing_class=agent.tokenizer)
    trainer.remove_callback(PrinterCallback)
    return trainer, n, n_mb


def _trl(setup) -> dict:
    trainer, n, n_mb = setup
    trainer.train()
    return {"units": n, "updates": n_mb}


def run(size: str, reps: int, work_dir: Path) -> SuiteResult:
    import importlib.util

    with workspace(size, work_dir) as cfg:
        t = 1
        _prepare_iteration(cfg, t)
        name = cfg.agents[-1].name
        gen = copy.deepcopy(cfg)
        gen.trainer = dataclasses.replace(cfg.trainer, recompute_old_logprobs=False)
        state = work_dir / "state"
        contenders = [Contender("stage", lambda ag: _ours(ag, cfg, name, t, state / "a"),
                                "train_learner, DeepSpeed engine, old log-probs recomputed (default)",
                                setup=lambda: _load(cfg, name, t)),
                      Contender("stage_gen_logprobs", lambda ag: _ours(ag, gen, name, t, state / "b"),
                                "the same, recompute_old_logprobs=false", setup=lambda: _load(cfg, name, t))]
        have_trl = importlib.util.find_spec("trl") is not None
        if have_trl:
            contenders.append(Contender("trl", _trl, "TRL GRPOTrainer.train(), generation replaced by the same batch",
                                        setup=lambda: _trl_setup(cfg, name, t, work_dir / "trl")))
        measured = compare(contenders, reps)
        _, comps, _, n_mb, mb = _trl_inputs(cfg, name, t)
        work = {"learner": f"{name} ({cfg.agent(name).arch})", "samples": len(comps), "mini_batches": n_mb,
                "samples_per_mini_batch": mb, "max_response_tokens": max(map(len, comps)),
                "algorithm": cfg.algorithm.name, "dtype": cfg.trainer.dtype, "threads": cfg.experiment.threads}
        goals, notes = [], []
        if have_trl:
            import trl

            work["trl"] = trl.__version__
            goals = [Goal("stage_gen_logprobs", "trl", 1.1), Goal("stage", "trl", 1.0)]
            if measured["trl"].units != measured["stage"].units:
                notes.append(f"TRL trained on {measured['trl'].units:.0f} samples (equal mini-batches), "
                             f"the stage on {measured['stage'].units:.0f}; rates are per sample")
        else:
            notes.append("TRL is not installed (make setup-bench): stage variants only")
    return SuiteResult("update", "samples", work, measured, goals, notes)
