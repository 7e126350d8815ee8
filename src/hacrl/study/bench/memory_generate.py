"""``memory_generate``: peak memory of generating long responses (512 new tokens on SmolLM2)
with and without a KV-cache budget, greedy as evaluate decodes and sampled as generate-rollouts
does, each cell in a process of its own (:func:`hacrl.study.bench.memory.generate_cell`).

The budget is the rollout job's ``resources.*.rollout.max_batch_tokens``: the rows of one
``generate`` call times (their longest prompt + the new tokens) stay within it, so the KV cache
and the per-step logits are bounded whatever the number of sequences; more calls, each smaller.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hacrl.study.bench.memory import _run_cell, pool

log = logging.getLogger(__name__)

DEFAULT_REPS = 1
GRID = {"full": {"rows": 8, "response": 512, "budget": 2048, "short_prompt": False},
        "smoke": {"rows": 16, "response": 16, "budget": 200, "short_prompt": True}}


def run(size: str, reps: int, work_dir: Path):
    """Greedy and sampled generation, whole and within the budget (``reps`` is ignored)."""
    from hacrl.study.bench.core import Goal, Measured, SuiteResult

    grid = GRID[size]
    model_dir, overrides, agent = pool(size, work_dir)
    measured: dict[str, Measured] = {}
    for mode, greedy in (("greedy", True), ("sampled", False)):
        for kind, budget in (("whole", 0), ("budget", grid["budget"])):
            name = f"{mode}-{kind}"
            spec = {"kind": "generate", "overrides": overrides, "agent": agent, "model_dir": str(model_dir),
                    "rows": grid["rows"], "response": grid["response"], "max_batch_tokens": budget, "greedy": greedy,
                    "short_prompt": grid["short_prompt"]}
            log.info("generation cell %s", name)
            out = _run_cell(spec)
            if "error" in out:
                raise RuntimeError(f"generation cell {name} failed: {out['error']}")
            note = (f"{'greedy (evaluate)' if greedy else 'sampled at T=1 (generate-rollouts)'}, "
                    + ("one generate call" if not budget else f"max_batch_tokens={budget}"))
            measured[name] = Measured(name, note, [out.pop("seconds")], float(out["tokens"]), out.pop("peak_rss_mib"), out)
    goals = [Goal("greedy-budget", "greedy-whole", 1 / 1.1), Goal("sampled-budget", "sampled-whole", 1 / 1.1)]
    work = {"model": "SmolLM2-135M-Instruct" if size == "full" else "tiny GPT-2", "rows": grid["rows"],
            "new_tokens": grid["response"], "kv_budget_tokens": grid["budget"], "dtype": "fp32", "threads": 2}
    notes = ["tokens/s counts the tokens generated (a sequence that ends early generates fewer)",
             "peak RSS is the cell process's ru_maxrss; the budget bounds the KV cache and per-step logits of a call"]
    return SuiteResult("memory_generate", "tokens", work, measured, goals, notes, baseline="greedy-whole")
