"""Run benchmark suites by name and write ``reports/bench/SUITE.json`` and ``.md``."""

from __future__ import annotations

import importlib
import logging
import tempfile
from pathlib import Path

from hacrl.study.bench import SUITES
from hacrl.study.bench.core import SuiteResult, table, write

log = logging.getLogger(__name__)

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
