"""``align``: cross-tokenizer experience per (producer, learner) tokenizer pair.

For every ordered pair of the pool's agents with different tokenizers, each of the producer's
iteration-1 rollout records is adapted for the learner as exchange-and-align does it
(:func:`hacrl.exchange.experience.adapt_response`: retokenise the text, locate both sides' tokens in it,
align the producer's log-prob trace onto the learner's tokens: THL). The baseline is the
retokenisation alone (encode, decode check) that any cross-tokenizer sharing needs; the ratio
is what the alignment costs on top. Units: records.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hacrl.study.bench.core import Contender, SuiteResult, compare
from hacrl.study.bench.workspace import workspace

log = logging.getLogger(__name__)
DEFAULT_REPS = 3


def run(size: str, reps: int, work_dir: Path) -> SuiteResult:
    import time

    from hacrl.agents.pool import load_tokenizer
    from hacrl.exchange import thl
    from hacrl.exchange.experience import adapt_response, read_records
    from hacrl.pipeline import table

    with workspace(size, work_dir) as cfg:
        t = 1
        table.run("generate-rollouts", cfg, t)
        lay = cfg.layout
        toks = {a.name: load_tokenizer(a, lay.checkpoint(0, a.name)) for a in cfg.agents}
        recs = {a.name: read_records(lay.rollouts(t) / f"{a.name}.parquet", "rollout") for a in cfg.agents}
        pairs = [(p.name, q.name) for p in cfg.agents for q in cfg.agents
                 if p.name != q.name and p.tokenizer_id != q.tokenizer_id]
        per_pair: dict[str, float] = {}

        def aligned() -> dict:
            n = 0
            for p, q in pairs:
                t0 = time.perf_counter()
                for r in recs[p].itertuples(index=False):
                    adapt_response(r, toks[p], toks[q], cfg.algorithm.thl)
                per_pair[f"{p}->{q}"] = round(len(recs[p]) / (time.perf_counter() - t0), 1)
                n += len(recs[p])
            return {"units": n, "records_per_s_by_pair": dict(per_pair)}

        def retokenize_only() -> int:
            n = 0
            for p, q in pairs:
                for text in recs[p]["response_text"]:
                    thl.retokenize(toks[q], text, append_eos=True)
                n += len(recs[p])
            return n

        measured = compare([Contender("retokenize_and_align", aligned, "adapt_response: retokenise + THL trace"),
                            Contender("retokenize_only", retokenize_only, "learner encode + decode check")], reps)
        work = {"pairs": len(pairs), "records_per_producer": {k: len(v) for k, v in recs.items()},
                "tokenizers": {a.name: f"{a.tokenizer.kind} ({len(toks[a.name])} tokens)" for a in cfg.agents}}
    return SuiteResult("align", "records", work, measured, [])
