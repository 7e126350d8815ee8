"""``memory``: peak memory of one learner's update against the batch it takes, with and without a
memory budget (``trainer.micro_batch_tokens``), each cell in a process of its own.

One cell: a learner (SmolLM2-135M-Instruct, or the tiny pool's GPT-2 at ``smoke`` size) takes
one optimizer update (one mini-batch: ``samples`` rows of a 64-token prompt and a
``response``-token response, GRPO, DeepSpeed) through :func:`hacrl.rl.step.train_learner`,
the code update-policies runs. The rows are synthetic (random tokens, rewards in a fixed
pattern with spread in every prompt group): memory and time depend on shapes, not on words.
The cell's process reports its peak resident memory (``ru_maxrss``: exact, not sampled), its
resident memory once the model and the optimizer are set up, the parameter count, and the
update's seconds. "Above the model and optimizer" subtracts that set-up memory and the
gradients and Adam's two moments (3 x 4 bytes per parameter, allocated at the first step).

``whole``: the mini-batch in one forward (the earlier behaviour; skipped where the memory model
says it would not fit this machine); ``budget``: micro-batches of at most ``micro_batch_tokens``
padded tokens. Goals (issue 24): an update of 512 x 512 within 4 GiB above model and optimizer;
at a fixed budget, peak memory grows at most 10 % from 32 to 512 samples; time per sample at
most 1.1x the whole mini-batch's where that fits.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROMPT_TOKENS = 64

GRID = {"full": {"samples": (32, 128, 512), "responses": (128, 512), "budget": 2048, "prompt": PROMPT_TOKENS},
        "smoke": {"samples": (8, 32), "responses": (16, 40), "budget": 128, "prompt": 16}}
"""Per size: mini-batch rows, response lengths, the budget (padded tokens) and the prompt length
(the tiny GPT-2 holds 64 positions)."""
SMOLLM2_DIR = Path("models/SmolLM2-135M-Instruct")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def synthetic_batch(tokenizer, learner: str, samples: int, response: int, prompt_tokens: int = PROMPT_TOKENS,
                    group: int = 8, seed: int = 0):
    """``samples`` learner-input rows of a ``prompt_tokens`` prompt and a ``response``-token
    response (random ids), in prompt groups of ``group`` rows."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    vocab = min(len(tokenizer), 30000)
    rows = []
    for i in range(samples):
        g = i // group
        prompt = rng.integers(10, vocab, prompt_tokens).tolist() if i % group == 0 else rows[-1]["input_prompt_ids"]
        resp = rng.integers(10, vocab, response).tolist()
        reward = float((i * 7 + g) % 3 == 0)
        rows.append({"record_type": "trajectory", "record_id": f"it1/{learner}/p{g}/{i % group}", "schema_version": 2,
                     "step": 1, "producer": learner, "producer_tokenizer": "t", "prompt_id": f"p{g}", "problem": "",
                     "gold": "0", "level": "add", "rendered_prompt": "", "prompt_token_ids": prompt,
                     "response_text": "", "response_token_ids": resp, "response_logprobs": [0.0] * response,
                     "finish_reason": "length", "sample_index": i % group, "reward": reward,
                     "verdict": "correct" if reward else "wrong", "advantage": 0.0, "learner": learner,
                     "is_self": True, "input_prompt_ids": prompt, "input_response_ids": resp,
                     "old_logprobs": [0.0] * response, "behavior_logprob_mean": 0.0,
                     "behavior_logprobs_aligned": [0.0] * response, "retokenized_exact": True})
    return pd.DataFrame(rows)


def cell(spec: dict) -> dict:
    """One update as ``spec`` says (in this process); returns its figures."""
    import dataclasses

    import torch

    from hacrl.agents.pool import load_agent
    from hacrl.pipeline import params
    from hacrl.rl.step import train_learner

    torch.set_num_threads(int(spec.get("threads", 2)))
    d = params.compose(spec["overrides"])
    cfg = params.from_dict(d)
    ac = cfg.agent(spec["agent"]) if spec.get("agent") else cfg.agents[0]
    tc = dataclasses.replace(cfg.trainer, micro_batch_tokens=spec["micro_batch_tokens"],
                             mini_batch_prompts=max(1, spec["samples"] // 8), lr_warmup_updates=1,
                             dtype=spec.get("dtype", "fp32"), gradient_checkpointing=spec.get("checkpointing", False),
                             zero_stage=spec.get("zero_stage", cfg.trainer.zero_stage))
    cfg = dataclasses.replace(cfg, trainer=tc, rollout=dataclasses.replace(cfg.rollout, group_size=8))
    agent = load_agent(ac, spec["model_dir"], tc.dtype)
    n_params = sum(p.numel() for p in agent.model.parameters())
    batch = synthetic_batch(agent.tokenizer, ac.name, spec["samples"], spec["response"],
                            spec.get("prompt", PROMPT_TOKENS))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = _rss_mib()
    t0 = time.time()
    stats = train_learner(agent, batch, cfg, seed=1, prev_state=Path(spec["work"]) / "none",
                          out_state=Path(spec["work"]) / "state")
    secs = time.time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state_mib = 3 * 4 * n_params / 2**20  # gradients + Adam's two fp32 moments
    gpu = {"cuda_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
           "cuda_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1)} if cuda else {}
    return {"peak_rss_mib": round(peak, 1), "setup_rss_mib": round(base, 1), "params": n_params, **gpu,
            "predicted_mib": round(predicted_mib(agent.model.config, n_params, spec, tc, on_gpu=cuda), 1),
            "above_model_and_optimizer_mib": round(peak - base - state_mib, 1), "seconds": round(secs, 2),
            "seconds_per_sample": round(secs / spec["samples"], 4), "loss": stats["loss"],
            "grad_norm": stats["grad_norm"], "micro_batches": stats.get("micro_batches", stats["updates"])}


def generate_cell(spec: dict) -> dict:
    """``spec["rows"]`` sequences of ``spec["response"]`` new tokens from one agent through the
    rollout engine, within a KV-cache budget (``max_batch_tokens``, 0: none); its peak RSS, time
    and tokens (greedy, as evaluate decodes, or sampled, as generate-rollouts does)."""
    import torch

    from hacrl.agents.pool import load_agent
    from hacrl.pipeline import params
    from hacrl.rollout.engine import SamplingParams
    from hacrl.rollout.hf import HFEngine

    torch.set_num_threads(int(spec.get("threads", 2)))
    cfg = params.from_dict(params.compose(spec["overrides"]))
    ac = cfg.agent(spec["agent"]) if spec.get("agent") else cfg.agents[0]
    agent = load_agent(ac, spec["model_dir"])
    # the tiny GPT-2 holds 64 positions: its smoke cells ask the bare sum
    tail = "" if spec.get("short_prompt") else " Explain every step at length."
    prompts = [agent.render(f"What is {i} + {3 * i + 7}?{tail}") for i in range(spec["rows"])]
    engine = HFEngine(agent.model, agent.tokenizer, batch_size=spec["rows"], max_batch_tokens=spec["max_batch_tokens"])
    base = _rss_mib()
    t0 = time.time()
    comps = engine.generate(prompts, SamplingParams(n=1, greedy=spec.get("greedy", True), temperature=1.0,
                                                    max_new_tokens=spec["response"], seed=1))
    secs = time.time() - t0
    tokens = sum(len(c.token_ids) for c in comps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_rss_mib": round(peak, 1), "setup_rss_mib": round(base, 1), "seconds": round(secs, 2),
            "tokens": tokens, "calls": len(engine.batches(sorted(len(agent.tokenizer(p)["input_ids"]) for p in prompts),
                                                         spec["response"]))}


def predicted_mib(config, n_params: int, spec: dict, tc, on_gpu: bool = False) -> float:
    """What the memory model (:mod:`hacrl.rl.memory`) says the cell's update needs at its peak:
    the micro-batch is the budget's rows of the cell's (equal) rows."""
    from hacrl.rl.memory import Shape, update_bytes

    seq = spec.get("prompt", PROMPT_TOKENS) + spec["response"]
    rows = spec["samples"] if not tc.micro_batch_tokens else max(1, min(spec["samples"], tc.micro_batch_tokens // seq))
    parts = update_bytes(Shape.of(config, n_params), rows * seq, rows * spec["response"], seq, tc.dtype,
                         tc.gradient_checkpointing, tc.logprob_chunk, tc.zero_stage, 1, attention_weights=not on_gpu)
    return sum(parts.values()) / 2**20


def _run_cell(spec: dict) -> dict:
    env = dict(os.environ, HACRL_STAGE_SERVER="0", OMP_NUM_THREADS=str(spec.get("threads", 2)))
    p = subprocess.run([sys.executable, "-m", "hacrl.study.bench.memory", json.dumps(spec)], capture_output=True,
                       text=True, env=env, timeout=spec.get("timeout_s", 7200))
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1][:300] if (p.stderr or p.stdout) else "failed"}
    return json.loads(p.stdout.strip().splitlines()[-1])


DEFAULT_REPS = 1
BUDGET_NOTE = "micro_batch_tokens={budget}, activation checkpointing"


def pool(size: str, work_dir: Path) -> tuple[Path, list[str], str]:
    """The model a cell loads, the overrides that configure it, and its agent's name: ``full``,
    SmolLM2-135M-Instruct in the SmolLM2 pool; ``smoke``, the tiny pool's first GPT-2 (prepared
    under ``work_dir``)."""
    if size == "full":
        from hacrl.agents.pretrained import fetch_smollm2

        model_dir = fetch_smollm2(SMOLLM2_DIR).resolve()
        return model_dir, ["agents=smollm2_mix", "experiment=smollm2", "tracking.enabled=false",
                           f"agents.pool.0.path={model_dir}"], "smollm2-135m"
    from hacrl.study.bench.workspace import SMOKE, workspace

    with workspace("smoke", work_dir / "pool"):
        pass
    return work_dir / "pool" / "runs" / "it0" / "checkpoints" / "gpt2-a", [*SMOKE, "tracking.enabled=false"], "gpt2-a"


def run(size: str, reps: int, work_dir: Path):
    """The grid of :data:`GRID` (one process per cell; ``reps`` is ignored: one update each)."""
    from hacrl.study.bench.core import Goal, Measured, SuiteResult

    grid = GRID[size]
    model_dir, overrides, _ = pool(size, work_dir)
    measured: dict[str, Measured] = {}
    cells = [("whole", grid["samples"][0], grid["responses"][0], 0, False)]
    cells += [("budget", s, r, grid["budget"], True) for r in grid["responses"] for s in grid["samples"]]
    for kind, samples, response, budget, ckpt in cells:
        name = f"{kind}-{samples}x{response}"
        spec = {"overrides": overrides, "model_dir": str(model_dir), "samples": samples, "response": response,
                "prompt": grid["prompt"],
                "micro_batch_tokens": budget, "checkpointing": ckpt, "work": str(work_dir / name)}
        log.info("memory cell %s", name)
        out = _run_cell(spec)
        if "error" in out:
            raise RuntimeError(f"memory cell {name} failed: {out['error']}")
        note = "the whole mini-batch in one forward, no checkpointing (the earlier behaviour)" if kind == "whole" \
            else BUDGET_NOTE.format(budget=budget)
        measured[name] = Measured(name, note, [out.pop("seconds")], float(samples), out.pop("peak_rss_mib"), out)
    small, big = grid["samples"][0], grid["samples"][-1]
    r_max = grid["responses"][-1]
    goals = [Goal(f"budget-{big}x{r_max}", "", 4096.0, kind="max_mib"),
             Goal(f"budget-{big}x{r_max}", f"budget-{small}x{r_max}", 1.10, kind="growth"),
             Goal(f"budget-{small}x{grid['responses'][0]}", f"whole-{small}x{grid['responses'][0]}", 1 / 1.1)]
    work = {"model": "SmolLM2-135M-Instruct" if size == "full" else "tiny GPT-2", "prompt_tokens": grid["prompt"],
            "algorithm": "grpo", "backend": "deepspeed", "dtype": "fp32", "threads": 2,
            "params": next(iter(measured.values())).extra["params"]}
    notes = ["one optimizer update per cell (one mini-batch of `samples` rows), each cell in a process of its "
             "own; peak RSS is that process's ru_maxrss",
             "above_model_and_optimizer_mib = peak - RSS once model and engine are set up - 12 bytes x params "
             "(gradients and Adam's two moments)",
             "samples/s in the table is samples per second of the update (the third goal: time per sample at "
             "most 1.1x the whole mini-batch's, i.e. throughput at least 0.91x)"]
    return SuiteResult("memory", "samples", work, measured, goals, notes, baseline=f"whole-{small}x{grid['responses'][0]}")


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(sys.argv[1])
    out = generate_cell(spec) if spec.get("kind") == "generate" else cell(spec)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
