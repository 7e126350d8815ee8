"""One GRPO update on SmolLM2-135M-Instruct in fp32 and in bf16, at ZeRO 0 and 1: the loss, the
gradient norm and the peak RSS of each (docs/SCALING.md, "bf16"). The same 32 synthetic rows of a
64-token prompt and a 128-token response (``hacrl.study.bench.memory.synthetic_batch``),
``micro_batch_tokens=2048`` with activation checkpointing, each update in a process of its own.

Prints one JSON line per update and writes ``reports/bench/bf16_vs_fp32.json``.
Usage: ``.venv/bin/python benchmarks/bf16_vs_fp32.py [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hacrl.storage import write_json
from hacrl.study.bench.memory import _run_cell, pool


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="hacrl-bf16-"))
    model_dir, overrides, _ = pool("full", work)
    out = {}
    for dtype, zero in (("fp32", 0), ("fp32", 1), ("bf16", 1), ("bf16", 0)):
        spec = {"overrides": overrides, "model_dir": str(model_dir), "samples": 32, "response": 128, "prompt": 64,
                "micro_batch_tokens": 2048, "checkpointing": True, "dtype": dtype, "zero_stage": zero,
                "work": str(work / f"{dtype}-zero{zero}")}
        r = _run_cell(spec)
        if "error" in r:
            raise SystemExit(f"{dtype} ZeRO {zero}: {r['error']}")
        out[f"{dtype}-zero{zero}"] = r
        print(json.dumps({"dtype": dtype, "zero_stage": zero, **r}), flush=True)
    write_json(Path("reports/bench/bf16_vs_fp32.json"), out)  # temp file, then rename
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
