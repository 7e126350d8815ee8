"""The rollout engine interface: the session every generator offers and how one is opened.

An engine turns rendered prompts into completions carrying what later stages need: text,
the generating model's token ids, their log-probs at the sampling temperature, and the
finish reason. Engines are listed, with their capabilities, in the engine table
(:mod:`hacrl.rollout.table`): transformers ``generate`` (:mod:`hacrl.rollout.hf`) and vLLM in
a worker process (:mod:`hacrl.rollout.vllm_engine`, over :mod:`hacrl.rollout.worker_engine`).
Each is opened by ``open(request)`` from one :class:`EngineRequest` and used as a session with
one lifecycle (:class:`RolloutEngine`): generate, take other weights, release its devices, close.
Whether the session's worker is the engine host's is a property of the session (``hosted``),
not something a caller probes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class EngineError(RuntimeError):
    """An engine process failed or died; the message carries its last log lines."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False
    seed: int = 0
    sampler: str = "multinomial"
    """``rollout.sampler``: how the transformers engine draws a token (others sample their own way)."""
    stop: tuple[str, ...] = ()
    """Strings that end a response (``agents[*].stop``): an engine may stop generating a
    sequence once one appears. Only a speed-up: :func:`cut_at_stop` cuts every engine's
    completions after the first stop string all the same, and the tokens before it do not depend
    on when generation stopped."""


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop" (EOS) or "length"


@dataclass
class EngineRequest:
    """Everything any engine needs to serve one agent's checkpoint; an engine reads what it uses."""

    model_dir: str | Path
    """The checkpoint (Hugging Face directory) the engine serves."""
    tokenizer: Any
    """The agent's tokenizer: prompts are encoded and completions decoded with it, whatever the engine."""
    model: Any = None
    """The loaded model: an in-process engine generates from it; others read its config."""
    batch_size: int = 512
    """Sequences per generate call (an engine that schedules its own batches ignores it)."""
    desc: str = "rollouts"
    """Its progress bar's label."""
    dtype: str = "float32"
    seed: int = 0
    threads: int = 2
    """CPU threads of the job (its share of the host's cores)."""
    cores: tuple[int, int] | None = None
    """(first core, count) the job may bind on a host cut into ``cpu:N`` shares; None: any."""
    env: dict[str, str] | None = None
    """Environment of an engine process: its devices (``CUDA_VISIBLE_DEVICES``)."""
    tensor_parallel_size: int = 1
    """The job's GPUs (1 on a CPU host)."""
    max_batch_tokens: int = 0
    """Token budget per forward batch (0: the engine's default)."""
    sleep_mode: bool = False
    """Start able to sleep (free its device memory while an update runs)."""
    settings: Any = None
    """The engine's own settings section (``engines.<section>`` of its row; None: it has none)."""
    host: str | Path | None = None
    """The workspace's engine host (its project directory), for an engine whose worker the host
    keeps across stages (``hostable``); None: the session starts its own worker."""
    engine: str = ""
    """The engine table's row (the host starts the row's worker)."""
    agent: str = ""
    """The agent the engine serves (the host keeps one worker per agent)."""
    host_idle_s: float = 900.0
    """How long the host keeps a worker no stage uses (``engines.host_idle_s``)."""
    weights_id: str = ""
    """The content hash of ``model_dir`` (DVC's): the host serves exactly these weights."""


class RolloutEngine(Protocol):
    """A session with a generator: what generate-rollouts needs, and its whole lifecycle (as
    verl's ``BaseRollout`` puts ``resume``, ``update_weights`` and ``release`` in its interface)."""

    hosted: bool
    """The session's worker belongs to the engine host: closing the session leaves it there."""
    cost: dict[str, float]
    """What opening the session took (``engine_startup_s``; a hosted one: ``engine_sync_s``,
    ``engine_hosted``, ``engine_reused``, ``engine_started``); empty for an in-process engine."""

    @classmethod
    def open(cls, request: EngineRequest) -> RolloutEngine:
        """A session serving ``request.model_dir``."""
        ...

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        """Return ``len(prompts) * params.n`` completions, prompt-major (a released engine
        serves again first)."""
        ...

    def load_weights(self, weights_dir: str | Path) -> dict:
        """Serve the weights of ``weights_dir`` (same architecture), in place or by a restart;
        returns ``{"seconds": s, "mode": "in_place" | "restart"}``."""
        ...

    def release(self, action: str) -> None:
        """Free the devices for an update: ``sleep`` keeps the worker where the engine can sleep
        (else it stops), ``stop`` stops it (the engine host's too)."""
        ...

    def close(self) -> None:
        """End the session: stop what the session started (a hosted worker stays with the host)."""
        ...


def cut_at_stop(comps: list[Completion], tokenizer, stop: tuple[str, ...] | list[str]) -> list[Completion]:
    """Each completion cut after the token that completes the first of the ``stop`` strings in
    its text (``agents[*].stop``: where a base model's few-shot answer ends), its log-probs with
    it; such a completion ends as one stopped by EOS does (``finish_reason: stop``).

    Applied to what any engine returns, so every engine cuts alike; the tokens after a stop
    string do not change the ones before it, so the cut sample is one the model could have
    stopped at. A completion without a stop string is returned as it is."""
    if not stop:
        return comps

    def text_of(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    out = []
    for c in comps:
        if not any(s in c.text for s in stop):
            out.append(c)
            continue
        lo, hi = 1, len(c.token_ids)  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in text_of(c.token_ids[:mid]) for s in stop):
                hi = mid
            else:
                lo = mid + 1
        ids = c.token_ids[:lo]
        out.append(dataclasses.replace(c, token_ids=ids, logprobs=c.logprobs[:lo], text=text_of(ids),
                                       finish_reason="stop"))
    return out
