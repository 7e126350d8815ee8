"""evaluate: greedy pass@1 on the held-out split per agent and level; the run's history."""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor

import pandas as pd

from hacrl.agents.pool import load_agent
from hacrl.agents.warmup import accuracy, greedy_accuracy, greedy_answers
from hacrl.config.schema import Config
from hacrl.exchange.experience import read_records
from hacrl.pipeline.stage_engines import place, verifier_lease
from hacrl.pipeline.result import Input, StageResult, numbers
from hacrl.resources import placement, plan_for
from hacrl.rl.algorithms import LOSSES
from hacrl.runtime import set_threads
from hacrl.storage import read_json, write_json
from hacrl.task.data import read_split
from hacrl.task.rewards import VerifierPool

log = logging.getLogger(__name__)


def standard_error(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def probe_accuracy(cfg: Config, agent, verifier, probes: dict[str, list[str]]) -> dict:
    """Greedy pass@1 of ``agent`` on named sets of training prompts (``NAME_accuracy``, ``NAME_n``;
    an empty set is left out): what a loss asks the evaluation to measure after its update."""
    by_id = {p["id"]: p for p in read_split(cfg.layout.tasks, "train")}
    out: dict = {}
    for key, ids in probes.items():
        if ids:
            acc, _ = greedy_accuracy(agent, [by_id[i] for i in ids], verifier, cfg.eval.max_new_tokens,
                                     cfg.eval.batch_size)
            out.update({f"{key}_accuracy": acc, f"{key}_n": len(ids)})
    return out


class _SerialVerifier:
    """A verifier pool shared with a checking thread: every call goes through that thread, so the
    pool has one caller at a time."""

    def __init__(self, pool, executor):
        self.pool, self.executor = pool, executor

    def verify(self, pairs, desc: str = "verify") -> list[str]:
        return self.executor.submit(self.pool.verify, pairs, desc).result()


def evaluate(cfg: Config, t: int) -> StageResult:
    """Greedy pass@1 on the held-out split (``eval.split``: or dev) per agent and level; extends
    the run history."""
    set_threads(cfg.experiment.threads)
    lay = cfg.layout
    held = read_split(cfg.layout.tasks, cfg.eval.split)
    update_stats = read_json(lay.update_stats(t)) if t > 0 else {}
    eplan = plan_for(cfg)  # evaluation generates where the agent's rollouts do
    hooks = LOSSES[cfg.algorithm.loss.name].hooks if t > 0 else None  # the loss's own probes (SGT: its rescues)
    metrics: dict = {"iteration": t, "agents": {}}
    # an agent's answers are checked (in the verifier's processes, driven from a thread) while the
    # next agent generates: checking costs about as much as generating here
    with VerifierPool.of(cfg.reward, lease=verifier_lease(cfg)) as ver, ThreadPoolExecutor(1) as checks:
        serial = _SerialVerifier(ver, checks)  # one caller of the pool at a time
        pending, extra = {}, {}
        for ac in cfg.agents:
            where = placement(cfg.resources, eplan.job(ac.name, "rollout"), cfg.experiment.threads)
            agent = place(load_agent(ac, lay.checkpoint(t, ac.name), cfg.trainer.dtype), where)
            answers = greedy_answers(agent, held, cfg.eval.max_new_tokens, cfg.eval.batch_size, where.max_batch_tokens)
            pending[ac.name] = checks.submit(ver.verify, answers, f"verify {ac.name}")
            if hooks is not None and hooks.probes is not None:  # e.g. SGT: did the rescues stick?
                extra[ac.name] = probe_accuracy(cfg, agent, serial, hooks.probes(update_stats.get(ac.name, {}), t))
            del agent
        for ac in cfg.agents:
            verdicts = pending[ac.name].result()
            acc = accuracy(verdicts)
            df = pd.DataFrame({"level": [p["level"] for p in held], "ok": [v == "correct" for v in verdicts]})
            m = {"eval_accuracy": acc, "eval_stderr": standard_error(acc, len(held)), "eval_n": len(held),
                 "by_level": {lvl: float(g["ok"].mean()) for lvl, g in df.groupby("level")}}
            if t > 0:
                rw = read_records(lay.rewards(t) / f"{ac.name}.parquet", "verdict")["reward"].dropna()
                m["train_reward"] = float(rw.mean())
                m["train_reward_stderr"] = float(rw.std(ddof=1) / math.sqrt(len(rw))) if len(rw) > 1 else 0.0
                us = update_stats[ac.name]
                m["entropy"] = us["entropy"]
                m["grad_norm"] = us["grad_norm"]
                for k in ("kl_to_init", "kl_init_before_step", *(hooks.history if hooks is not None else ())):
                    if k in us:
                        m[k] = us[k]
                m.update(extra.get(ac.name, {}))
            metrics["agents"][ac.name] = m
    prev = read_json(lay.history(t - 1)) if t > 0 else {"iterations": []}
    before = prev["iterations"][-1]["agents"] if prev["iterations"] else {}
    label = "held-out" if cfg.eval.split == "heldout" else cfg.eval.split  # a tuning run reads dev
    for name, m in metrics["agents"].items():  # one line per agent, in points, with the change
        was = before.get(name, {}).get("eval_accuracy")
        log.info("%s it%d %s: %.1f %% +- %.1f%s", label, t, name, 100 * m["eval_accuracy"], 100 * m["eval_stderr"],
                 f" ({100 * (m['eval_accuracy'] - was):+.1f} since it{t - 1})" if was is not None else "")
    history = {"algorithm": cfg.algorithm.name,
               "iterations": [h for h in prev["iterations"] if h["iteration"] < t] + [metrics]}
    write_json(lay.eval_metrics(t), headline_metrics(metrics))
    write_json(lay.history(t), history)
    write_json(lay.evaluated(t), {"evaluated": t})  # constant: what follows waits, never goes stale
    # the held-out figures go with the checkpoint and the held-out set; training figures the
    # update already logged (entropy, KL, reward) are not logged twice
    held_out = ("eval_accuracy", "eval_stderr", "eval_n", "by_level")
    return StageResult(metrics,
                       evaluation={a: numbers({k: v for k, v in m.items() if k in held_out})
                                   for a, m in metrics["agents"].items()},
                       agents={a: numbers({k: v for k, v in m.items() if k in extra.get(a, {})
                                           or k == "train_reward_stderr"}) for a, m in metrics["agents"].items()},
                       evaluated={a.name: str(lay.checkpoint(t, a.name)) for a in cfg.agents},
                       dataset=Input(cfg.eval.split, str(lay.tasks / f"{cfg.eval.split}.jsonl"), "evaluation"))


HEADLINE = ("eval_accuracy", "eval_stderr", "train_reward")


def headline_metrics(metrics: dict) -> dict:
    """What ``dvc metrics show`` prints per iteration: held-out accuracy, its standard error and
    the training reward of each agent (a few columns; every figure is in the history file)."""
    return {"iteration": metrics["iteration"],
            "agents": {a: {k: m[k] for k in HEADLINE if k in m} for a, m in metrics["agents"].items()}}
