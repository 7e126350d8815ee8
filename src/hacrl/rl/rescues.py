"""SGT's rescues: what success-gated transfer records around a learner's step.

The SGT loss (:func:`hacrl.rl.algorithms.sgt_loss`) flags each injected peer success as
``rescued`` in its per-sample outputs. From those flags this module makes the step's figures
(which prompts were rescued, how many successes were injected, the trigger rate), keeps the
learner's cumulative record of rescued prompts in its train state (prompt id -> the iteration of
its first rescue), and names the prompt sets the evaluation scores after the update: those
rescued now and those rescued before (whether a rescue still holds later). The update, the
update stage and the evaluation call these through the loss's registered hooks
(:class:`hacrl.rl.algorithms.StepHooks`), never by the algorithm's name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hacrl.storage import write_json

RESCUED_FILE = "rescued_prompts.json"
"""In a learner's train state: prompt id -> the iteration SGT first rescued it (cumulative)."""
PRIVATE = ("rescued_so_far", "rescued_prompts")
"""Records among the step's figures: kept in update_stats.json, not logged as figures."""
HISTORY = ("trigger_rate", "rescues")
"""Step figures the evaluation keeps in the run history."""


def figures(samples: list[tuple[Any, dict]], batch: Any) -> dict:
    """SGT's step figures from the rows a loss flagged ``rescued`` (in any update): the prompts
    rescued (sorted ids), how many peer responses were injected, the prompts whose own samples
    were all wrong, and the trigger rate (rescued prompts over the learner's prompts)."""
    if not samples or "rescued" not in samples[0][1]:
        return {}
    rescued = sorted({int(i) for idx, vals in samples for i, r in zip(idx, vals["rescued"].numpy()) if r > 0})
    own = batch[batch["is_self"].astype(bool)]
    per_prompt = own.groupby("prompt_id")["verdict"].apply(lambda v: bool((v == "correct").any()))
    prompts = sorted(set(batch["prompt_id"].iloc[rescued]))
    return {"rescued_prompts": prompts, "rescues": len(rescued),
            "own_all_wrong_prompts": int((~per_prompt).sum()),
            "trigger_rate": len(prompts) / max(1, len(per_prompt))}


def carry(prev_state: Path | None, state: Path, stats: dict, t: int) -> None:
    """Extend the learner's record of rescued prompts with iteration ``t``'s (in ``state``) and
    give the whole record to the step's figures (``rescued_so_far``, what the evaluation reads)."""
    if "rescued_prompts" not in stats:
        return
    prev_file = prev_state / RESCUED_FILE if prev_state is not None else None
    so_far = json.loads(prev_file.read_text()) if prev_file is not None and prev_file.exists() else {}
    so_far.update({p: t for p in stats["rescued_prompts"] if p not in so_far})
    write_json(state / RESCUED_FILE, so_far)
    stats["rescued_so_far"] = so_far


def probes(stats: dict, t: int) -> dict[str, list[str]]:
    """The training prompts rescued at iteration ``t`` (``rescued_now``) and earlier
    (``rescued_before``), sorted by id. Before its rescue the learner had 0 of G right on each."""
    rescued = stats.get("rescued_so_far") or {}
    return {"rescued_now": [i for i, it in sorted(rescued.items()) if it == t],
            "rescued_before": [i for i, it in sorted(rescued.items()) if it < t]}
