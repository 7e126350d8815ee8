"""The whole experiment in one process, through the same stage functions as ``dvc repro``.

The DVC path starts one process per stage; this path shares the imports. It is what a
comparison suite uses, and what measures the orchestration overhead. Stages come from the stage
table in its order; rollout engines that are worth keeping (``keeps_alive`` in the engine
table) live across iterations and are synced to each new checkpoint.
"""

from __future__ import annotations

import time

from hacrl.config.schema import Config
from hacrl.pipeline import table
from hacrl.pipeline.stage_engines import release_engine
from hacrl.resources import plan_for
from hacrl.rollout.table import engine_spec


def prepare_experiment(cfg: Config, run=None) -> None:
    """The preparation: the prepare stages, then the iteration stages' runs at iteration 0 (the
    warm-up evaluation). ``run(name, t)``: how to run one (default :func:`hacrl.pipeline.table.run`)."""
    run = run or (lambda name, t: table.run(name, cfg, t))
    for s in table.STAGES:
        if s.kind == table.PREPARE:
            run(s.name, 0)
    for s in table.STAGES:
        if s.at_zero:
            run(s.name, 0)


def run_iteration_until(cfg: Config, t: int, stop: str) -> None:
    """Iteration ``t``'s stages before stage ``stop`` (what a benchmark of ``stop`` starts from)."""
    for name in table.iteration_stages():
        if name == stop:
            return
        table.run(name, cfg, t)
    raise ValueError(f"{stop!r} is not an iteration stage")


def run_in_process(cfg: Config, iterations: int | None = None, prepare: bool = True) -> dict:
    """Run the experiment's stages (``prepare``: the preparation too, with the iteration-0
    evaluation) and its report in this process; returns seconds per stage name."""
    timings: dict[str, float] = {}

    def timed(name: str, t: int, **kwargs):
        t0 = time.time()
        out = table.run(name, cfg, t, **kwargs)
        timings[name] = timings.get(name, 0.0) + time.time() - t0
        return out

    if prepare:
        prepare_experiment(cfg, timed)
    live: dict | None = {} if engine_spec(cfg.rollout.engine).keeps_alive else None
    rplan = plan_for(cfg)
    before_updates = [r for r in rplan.releases if rplan.waves[r.before].stage == "update"]
    try:
        for t in range(1, (iterations or cfg.experiment.iterations) + 1):
            for s in table.STAGES:
                if s.kind != table.ITERATION:
                    continue
                if s.jobs == "update":  # engines whose devices an update needs sleep or stop first
                    for rel in before_updates:
                        release_engine(live, rel)
                timed(s.name, t, **({"live": live} if s.live_engines else {}))
    finally:
        for engine in (live or {}).values():
            engine.close()
    for s in table.STAGES:
        if s.kind == table.REPORT:
            timed(s.name, 0)
    return timings
