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

A row also says whether the workspace's engine host can keep the engine's worker process across
stages (``hostable``: an engine whose model runs in a worker process,
:class:`hacrl.rollout.worker_engine.WorkerEngine`; the host starts the worker its class names),
and its ``section``, the settings of its own under ``engines.<section>`` (None: it has none).

Every engine class implements the session interface :class:`hacrl.rollout.engine.RolloutEngine`
and is made by its ``open(request)`` class method from an
:class:`hacrl.rollout.engine.EngineRequest`. A new engine: one module under ``rollout/``, one row
here, its preset ``conf/rollout/NAME.yaml`` and its module among the generate stage's
``dvc.yaml`` dependencies (and a settings section in ``config/schema.py`` if it has settings).
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
    hostable: bool = False
    """Its worker process may be kept by the engine host across stages (``worker`` of its class)."""
    section: str | None = None
    """Its settings: ``engines.<section>`` (None: none)."""
    doc: str = ""

    def load(self) -> type:
        """The engine's class (imported on first use)."""
        return load_entry(self.entry)

    def settings(self, engines) -> object | None:
        """Its settings section of ``engines`` (an ``EnginesConfig``), or None."""
        return getattr(engines, self.section) if self.section else None


def load_entry(entry: str):
    """The object ``module:name`` names (imported on first use)."""
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec("hf", "hacrl.rollout.hf:HFEngine", in_process=True, exact_logprobs=True,
                     keeps_alive=False, can_sleep=False,
                     doc="transformers generate (batched, KV cache) in the stage's process"),
    "vllm": EngineSpec("vllm", "hacrl.rollout.vllm_engine:VLLMEngine", in_process=False, exact_logprobs=False,
                       keeps_alive=True, can_sleep=True, hostable=True, section="vllm",
                       doc="vLLM in its own environment and process (make setup-vllm), JSON lines over pipes"),
}
"""Rollout engines by the name ``rollout.engine`` takes."""


def engine_spec(name: str) -> EngineSpec:
    """The row of ``name`` (checked at start-up: :func:`hacrl.pipeline.checks.validate`)."""
    return ENGINES[name]
