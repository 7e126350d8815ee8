"""The memory model (src/hacrl/rl/memory.py) checked at a second model size: the embedded
experiment's largest agent (qwen2-strong, 3 layers, hidden 96) takes one GRPO update of 192
synthetic rows (a 16-token prompt and a 256-token response: 52k tokens), the whole mini-batch in
one forward without checkpointing, and then within ``micro_batch_tokens=2048`` with checkpointing.
Each update runs in a process of its own; the figures are its peak RSS above the set-up, against
what the model predicts for the same shapes (docs/SCALING.md, "Memory").

Needs the embedded experiment's iteration-0 checkpoints (``make run``). Prints one JSON line per
update and writes ``reports/bench/memory_model_embedded.json``.
Usage: ``.venv/bin/python benchmarks/memory_model_embedded.py [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hacrl.storage import write_json
from hacrl.study.bench.memory import _run_cell

AGENT = "qwen2-strong"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="hacrl-memmodel-"))
    model_dir = Path("runs/it0/checkpoints") / AGENT
    if not model_dir.is_dir():
        raise SystemExit(f"{model_dir} does not exist: run `make run` first")
    out = {}
    for name, budget, ckpt in (("whole", 0, False), ("budget", 2048, True)):
        spec = {"overrides": ["tracking.enabled=false"], "agent": AGENT, "model_dir": str(model_dir.resolve()),
                "samples": 192, "response": 256, "prompt": 16, "micro_batch_tokens": budget, "checkpointing": ckpt,
                "work": str(work / name)}
        r = _run_cell(spec)
        if "error" in r:
            raise SystemExit(f"{name}: {r['error']}")
        r["model_above_setup_mib"] = round(r["predicted_mib"] - 4 * r["params"] / 2**20, 1)  # weights are in the set-up
        r["measured_above_setup_mib"] = round(r["peak_rss_mib"] - r["setup_rss_mib"], 1)
        out[name] = r
        print(json.dumps({"cell": name, **r}), flush=True)
    write_json(Path("reports/bench/memory_model_embedded.json"), out)  # temp file, then rename
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
