"""Run benchmark suites by name and write ``reports/bench/SUITE.json`` and ``.md``.

``hacrl bench SUITE``: this project's stages side by side with what a user would run instead.

Every suite measures one piece of work two or more ways in the same process run, interleaving
the contenders' repetitions (A B C A B C ...) after one warm-up each, so a machine that slows
down mid-run slows every contender alike. A suite reports each contender's median and spread,
the ratio of throughputs against the named baseline, peak RSS (the contender's process tree),
and whether the issue's goal for that ratio is met. Absolute seconds drift on shared machines;
the ratios are the claim.

Suites live in one module each (:mod:`hacrl.study.bench.rollout`, ...) and expose
``run(size: str, reps: int, work_dir: Path) -> SuiteResult``.
"""

from __future__ import annotations

import importlib
import logging
import tempfile
from pathlib import Path

from hacrl.study.bench.core import SuiteResult, table, write

log = logging.getLogger(__name__)

SUITES = ("rollout", "rollout_smollm2", "update", "update_smollm2", "verify", "evaluate", "align", "pipeline",
          "memory", "memory_generate", "pretrained_iteration")
"""In the order ``hacrl bench all`` runs them."""

SIZES = ("smoke", "full")
"""``full``: the default, a few minutes per suite on a 2-core machine; ``smoke``: seconds, for CI
(the figures of a smoke run say little; it checks that the suite runs end to end)."""


def run_suite(name: str, size: str = "full", reps: int | None = None, out_dir: Path = Path("reports/bench"),
              work_dir: Path | None = None) -> list[SuiteResult]:
    """Run one suite (or ``all``), print its table, write its files; return the results."""
    if name != "all" and name not in SUITES:
        raise ValueError(f"unknown suite {name!r} (choose from all, {', '.join(SUITES)})")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (choose from {', '.join(SIZES)})")
    results = []
    for s in SUITES if name == "all" else (name,):
        mod = importlib.import_module(f"hacrl.study.bench.{s}")
        r = reps if reps is not None else (2 if size == "smoke" else mod.DEFAULT_REPS)
        with tempfile.TemporaryDirectory(prefix=f"hacrl-bench-{s}-", dir=work_dir) as tmp:
            log.info("bench %s (%s, %d rounds)", s, size, r)
            res = mod.run(size, r, Path(tmp))
        res.size, res.reps = size, r
        path = write(res, Path(out_dir))
        print(table(res))
        print(f"wrote {path} and {path.with_suffix('.md')}")
        results.append(res)
    return results
