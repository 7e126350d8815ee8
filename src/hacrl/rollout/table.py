"""The engine table: every rollout engine once, with what it can do.

``rollout.engine`` names a row. A row names its class by dotted path, imported only when a
stage first opens that engine (so validating a config, or ``hacrl --help``, imports neither
torch nor vLLM's client), and declares the capabilities the rest of the pipeline reads instead
of comparing engine names or probing methods:

- ``in_process``: generates in the stage's own process from the model the stage loaded (the
  stage places it on the job's device, and holds the process-wide generation lock);
- ``exact_logprobs``: the log-probs it records are bit for bit the trainer's forward on the same
  tokens, so an update may skip recomputing pi_old for an own sample;
- ``keeps_alive``: a process worth keeping across iterations (its start-up costs seconds), which
  an in-process run keeps and syncs to new weights;
- ``can_sleep``: frees its device memory while keeping its process (vLLM's sleep mode), which
  MWRA's ``engine_release: sleep`` uses before an update needs the device.

Every engine class implements :class:`hacrl.rollout.engine.RolloutEngine` and is made by its
``open(request)`` class method from an :class:`hacrl.rollout.engine.EngineRequest`. A new engine:
one module under ``rollout/`` and one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine: its name, its class as ``module:Class`` and its capabilities."""

    name: str
    entry: str
    in_process: bool
    exact_logprobs: bool
    keeps_alive: bool
    can_sleep: bool
    doc: str = ""

    def load(self) -> type:
        """The engine's class (imported on first use)."""
        module, _, attr = self.entry.partition(":")
        return getattr(importlib.import_module(module), attr)


ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec("hf", "hacrl.rollout.hf:HFEngine", in_process=True, exact_logprobs=True,
                     keeps_alive=False, can_sleep=False,
                     doc="transformers generate (batched, KV cache) in the stage's process"),
    "vllm": EngineSpec("vllm", "hacrl.rollout.vllm_engine:VLLMEngine", in_process=False, exact_logprobs=False,
                       keeps_alive=True, can_sleep=True,
                       doc="vLLM in its own environment and process (make setup-vllm), JSON lines over pipes"),
}
"""Rollout engines by the name ``rollout.engine`` takes."""


def engine_spec(name: str) -> EngineSpec:
    """The row of ``name`` (checked at start-up: :func:`hacrl.pipeline.checks.validate`)."""
    return ENGINES[name]
