"""THL residuals for every (producer, learner) pair of a finished run, under both word
segmentations: the table of docs/ALGORITHMS.md, "THL".

    python benchmarks/thl_residuals.py [--runs runs] [--params params.yaml]

Reads every iteration's published ``trajectory`` shards and the agents' tokenizers (iteration 0
checkpoints); aligns each record onto every other agent's tokenizer (``peer_eos`` as
configured) and prints one Markdown row per pair and segmentation.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    from hacrl.agents.pool import load_tokenizer
    from hacrl.exchange.experience import pair_residuals, read_records
    from hacrl.pipeline import params
    from hacrl.storage import RunLayout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    cfg = params.load(args.params)
    lay = RunLayout(args.runs)
    toks = {a.name: load_tokenizer(a, lay.checkpoint(0, a.name)) for a in cfg.agents}
    iters = [t for t in range(1, cfg.experiment.iterations + 1) if lay.exchange(t).exists()]
    recs = {a.name: pd.concat([read_records(lay.published(t, a.name, "trajectory"), "trajectory") for t in iters],
                              ignore_index=True) for a in cfg.agents}
    kind = {a.name: a.tokenizer_id for a in cfg.agents}
    print(f"iterations {iters[0]}-{iters[-1]}, {sum(map(len, recs.values()))} records\n")
    print("| producer -> learner | segmentation | records | round-trip mismatch | straddling tokens | "
          "unmatched tokens | mass error mean | mass error max |")
    print("|---|---|---|---|---|---|---|---|")
    for seg in ("whitespace", "unicode_words"):
        thl = dataclasses.replace(cfg.algorithm.thl, segmentation=seg)
        for p in toks:
            for q in toks:
                if p == q:
                    continue
                r = pair_residuals(recs[p], toks[p], toks[q], thl, len(recs[p]))
                print(f"| {kind[p]} -> {kind[q]} | {seg} | {r['records']} | {100 * r['round_trip_mismatch']:.2f} % | "
                      f"{100 * r['straddle_share']:.2f} % | {100 * r['unmatched_share']:.2f} % | "
                      f"{r['mass_error_mean']:.2e} | {r['mass_error_max']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
