"""``evaluate``: the evaluate stage against a bare batched greedy ``generate``.

Both load every agent's checkpoint and generate greedily for the held-out prompts in the
stage's batch size; the stage also checks each answer with math-verify and writes the metrics
and history. ``stage_hosted`` is the stage as ``hacrl stage`` runs it under ``dvc repro`` and
Prefect: its verifier workers come from the engine host, started between stages. Units:
held-out answers (agents x problems).
"""

from __future__ import annotations

import logging
from pathlib import Path

from hacrl.study.bench.core import Contender, Goal, SuiteResult, as_stage_process, compare
from hacrl.study.bench.workspace import workspace

log = logging.getLogger(__name__)
DEFAULT_REPS = 3


def bare_greedy(cfg, t: int = 0) -> int:
    """Load, render, left-pad, ``generate(do_sample=False)`` in batches; decode the answers."""
    import torch

    from hacrl.agents.pool import load_agent
    from hacrl.storage import RunLayout
    from hacrl.task.data import read_split

    held = read_split(cfg.layout.tasks, "heldout")
    n = 0
    for ac in cfg.agents:
        agent = load_agent(ac, RunLayout(cfg.experiment.runs_dir).checkpoint(t, ac.name), cfg.trainer.dtype)
        tok, model = agent.tokenizer, agent.model
        enc = [tok(agent.render(p["problem"]), add_special_tokens=False)["input_ids"] for p in held]
        order = sorted(range(len(enc)), key=lambda i: len(enc[i]))  # as the engine batches them
        with torch.no_grad():
            for b0 in range(0, len(order), cfg.eval.batch_size):
                batch = [enc[i] for i in order[b0:b0 + cfg.eval.batch_size]]
                L = max(map(len, batch))
                ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in batch])
                attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
                out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=cfg.eval.max_new_tokens,
                                     do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                tok.batch_decode(out[:, L:], skip_special_tokens=True)
                n += len(batch)
    return n


def run(size: str, reps: int, work_dir: Path) -> SuiteResult:
    from hacrl.pipeline import table
    from hacrl.task.data import read_split

    with workspace(size, work_dir) as cfg:
        def stage() -> dict:
            m = table.run("evaluate", cfg, 0)
            return {"units": sum(a["eval_n"] for a in m["agents"].values()),
                    "accuracy": {k: round(a["eval_accuracy"], 4) for k, a in m["agents"].items()}}

        def settled() -> None:
            """Untimed: wait until the host's restocked verifier workers finished their imports
            (under dvc repro they import during the stages between two evaluations), so that no
            contender is timed beside them."""
            import time

            from hacrl.rollout import engine_host

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                st = engine_host.status(Path.cwd()) or {}
                if st.get("verifiers_ready", 0) >= st.get("verifiers_stocked", 0):
                    return
                time.sleep(0.1)

        try:
            measured = compare([Contender("stage", lambda _: stage(), "evaluate: greedy generate + math-verify + "
                                          "metrics", setup=settled),
                                Contender("stage_hosted", lambda _: as_stage_process(stage), "the same, verifier workers from "
                                          "the engine host (as under dvc repro / Prefect)", setup=settled),
                                Contender("bare_generate", lambda _: bare_greedy(cfg, 0),
                                          "transformers greedy generate, same batches, no checking",
                                          setup=settled)], reps)
        finally:
            from hacrl.rollout import engine_host

            engine_host.stop(Path.cwd())
        work = {"agents": ", ".join(a.name for a in cfg.agents), "heldout": len(read_split(cfg.layout.tasks, "heldout")),
                "max_new_tokens": cfg.eval.max_new_tokens, "batch_size": cfg.eval.batch_size,
                "verifier_workers": cfg.reward.workers}
    return SuiteResult("evaluate", "answers", work, measured, [Goal("stage", "bare_generate", 0.9),
                                                               Goal("stage_hosted", "bare_generate", 0.9)])
