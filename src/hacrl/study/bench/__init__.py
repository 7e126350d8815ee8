"""``hacrl bench SUITE``: this project's stages side by side with what a user would run instead.

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

SUITES = ("rollout", "rollout_smollm2", "update", "verify", "evaluate", "align", "pipeline")
"""In the order ``hacrl bench all`` runs them."""
