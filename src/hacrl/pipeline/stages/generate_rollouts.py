"""generate-rollouts: the step's prompts (the same for every agent) x G samples per agent."""

from __future__ import annotations

import contextlib
import logging
import time

from hacrl.agents.pool import load_agent
from hacrl.agents.scoring import pack, response_span, token_logprobs
from hacrl.config.schema import Config
from hacrl.exchange.experience import rollout_records, write_records
from hacrl.pipeline.stage_engines import LOADING, SERIAL, StageEngines, place
from hacrl.pipeline.result import StageResult, compact, numbers
from hacrl.pipeline.table import output_identity
from hacrl.resources import placement, plan_for, run_stage
from hacrl.rollout.engine import SamplingParams, cut_at_stop
from hacrl.rollout.table import engine_spec
from hacrl.runtime import set_threads
from hacrl.seeds import hash_seed
from hacrl.storage import atomic_path
from hacrl.task import data as task_data

log = logging.getLogger(__name__)


def generate_rollouts(cfg: Config, t: int, live: dict | None = None) -> StageResult:
    """The step's prompts (same for all agents) x ``G`` samples per agent, as Parquet shards.

    Agents run as the MWRA plan places them (one after another on a CPU host; at once where
    their devices do not overlap). ``live``: engines kept across iterations by an in-process run
    (see :func:`hacrl.pipeline.stage_engines.open_engine`); the plan's releases apply to them.
    """
    set_threads(cfg.experiment.threads)
    log.info("── iteration %d/%d (%s) ──", t, cfg.experiment.iterations, cfg.algorithm.name)
    lay = cfg.layout
    prompts = task_data.prompts_for_iteration(task_data.read_split(cfg.layout.tasks, "train"), cfg.rollout.prompts_per_iteration,
                                              cfg.experiment.seed, t)
    r = cfg.rollout
    spec = engine_spec(r.engine)
    rplan = plan_for(cfg)
    # resolved here, before the jobs' threads: transformers' lazy attributes are not thread-safe
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    with atomic_path(lay.rollouts(t), is_dir=True,
                     identity=output_identity(cfg, lay.rollouts(t), "generate-rollouts", t)) as tmp, \
            StageEngines(cfg, live) as engines:
        def job(j) -> dict:
            ac = cfg.agent(j.agent)
            where = placement(cfg.resources, j, cfg.experiment.threads)
            t0 = time.time()
            with LOADING:
                agent = load_agent(ac, lay.checkpoint(t - 1, ac.name), cfg.trainer.dtype)
            if spec.in_process:  # it generates from this process's model, on the job's device
                place(agent, where)
            with SERIAL if spec.in_process else contextlib.nullcontext():
                engine = engines.open(ac, agent, lay.checkpoint(t - 1, ac.name), where)
                rendered = [agent.render(p["problem"]) for p in prompts]
                params = SamplingParams(n=cfg.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                                        sampler=r.sampler, max_new_tokens=r.max_new_tokens, stop=agent.stop,
                                        seed=hash_seed(cfg.experiment.seed, "rollout", t, ac.name))
                t1 = time.time()
                try:
                    comps = cut_at_stop(engine.generate(rendered, params), agent.tokenizer, agent.stop)
                finally:
                    engines.done(ac.name, engine)
                gen_s = time.time() - t1
            write_records(tmp / f"{ac.name}.parquet",
                          rollout_records(t, ac.name, ac.tokenizer_id, prompts, rendered, comps), "rollout")
            secs = time.time() - t0
            ntok = sum(len(c.token_ids) for c in comps)
            st = {"samples": len(comps), "tokens": ntok, "seconds": round(secs, 2),
                  "tokens_per_s": round(ntok / max(secs, 1e-9), 1),
                  "generate_tokens_per_s": round(ntok / max(gen_s, 1e-9), 1), **engine.cost}
            if cfg.engines.logprob_check_samples:
                with SERIAL:
                    st.update(logprob_gap(agent.model, comps, agent.tokenizer.pad_token_id, r.temperature,
                                          cfg.engines.logprob_check_samples))
            log.info("rollouts %s: %s", ac.name, compact(st, ("samples", "tokens", "seconds", "tokens_per_s")))
            log.debug("rollouts %s: %s", ac.name, st)
            return st

        done = run_stage(rplan, "rollout", job, release=engines.release)
    return StageResult({a.name: done[a.name] for a in cfg.agents},
                       agents={a.name: numbers(done[a.name], "rollout_") for a in cfg.agents})


def logprob_gap(model, comps: list, pad_id: int, temperature: float, samples: int, batch: int = 16) -> dict:
    """How far the engine's recorded log-probs are from the trainer's forward on the same tokens:
    mean and max absolute difference per response token over ``samples`` evenly spaced
    completions. Every importance ratio built on recorded log-probs carries this error."""
    import torch

    picked = [c for c in comps[:: max(1, len(comps) // max(1, samples))] if c.token_ids][:samples]
    if not picked:
        return {}
    diffs = []
    model.eval()
    with torch.no_grad():
        for b0 in range(0, len(picked), batch):
            part = picked[b0:b0 + batch]
            ids, attn, resp = pack([c.prompt_token_ids for c in part], [c.token_ids for c in part], pad_id)
            # the head projects the response positions only (the same bits: see token_logprobs)
            lp = token_logprobs(model, ids, attn, temperature, span=response_span(resp))
            for i, c in enumerate(part):
                mine = lp[i][resp[i].bool()]
                diffs.append((mine - torch.tensor(c.logprobs, dtype=mine.dtype)).abs())
    d = torch.cat(diffs)
    return {"logprob_gap_mean": float(d.mean()), "logprob_gap_max": float(d.max()), "logprob_gap_tokens": int(d.numel())}
