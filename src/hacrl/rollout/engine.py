"""The rollout engine interface: what every generator implements and how one is made.

An engine turns rendered prompts into completions carrying what later stages need: text,
the generating model's token ids, their log-probs at the sampling temperature, and the
finish reason. Engines are listed, with their capabilities, in the engine table
(:mod:`hacrl.rollout.table`): transformers ``generate`` (:mod:`hacrl.rollout.hf`) and vLLM in
its own process (:mod:`hacrl.rollout.vllm_engine`). Each is made by ``open(request)`` from one
:class:`EngineRequest`, so the pipeline opens any of them the same way.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hacrl.config.schema import EnginesConfig


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
    """The loaded model, for an engine that generates in the stage's process."""
    batch_size: int = 512
    """Sequences per generate call (an engine that schedules its own batches ignores it)."""
    desc: str = "rollouts"
    """Its progress bar's label."""
    dtype: str = "float32"
    seed: int = 0
    threads: int = 2
    """CPU threads of an engine process on a CPU host."""
    env: dict[str, str] | None = None
    """Environment of an engine process: its devices (``CUDA_VISIBLE_DEVICES``) or CPU cores."""
    tensor_parallel_size: int = 1
    max_batch_tokens: int = 0
    """Token budget per forward batch (0: the engine's default)."""
    max_model_len: int = 4096
    """Prompt + response tokens per sequence."""
    sleep_mode: bool = False
    """Start able to sleep (free its device memory while an update runs)."""
    settings: EnginesConfig = field(default_factory=EnginesConfig)
    """How engine processes run (``engines.*``)."""
    host: str | Path | None = None
    """The workspace's engine host (its socket), for an engine with a process worth keeping
    (``keeps_alive``): the host keeps the process across stages; None: the engine's own."""
    agent: str = ""
    """The agent the engine serves (the host keeps one engine per agent)."""
    host_idle_s: float = 900.0
    """How long the host keeps an engine no stage uses (``engines.host_idle_s``)."""
    weights_id: str = ""
    """The content hash of ``model_dir`` (DVC's): the host serves exactly these weights."""


class RolloutEngine(Protocol):
    """What generate-rollouts and evaluate need from a generator. Which of the lifecycle calls an
    engine supports is declared in the engine table (``keeps_alive``: ``reload``; ``can_sleep``:
    ``sleep``/``wake``); ``close`` always exists."""

    startup_s: float | None
    """Seconds its start took, for an engine with a process of its own (None: none)."""

    @classmethod
    def open(cls, request: EngineRequest) -> RolloutEngine:
        """Start an engine serving ``request.model_dir``."""
        ...

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        """Return ``len(prompts) * params.n`` completions, prompt-major."""
        ...

    def reload(self, weights_dir: str | Path) -> dict:
        """Serve the weights of ``weights_dir`` (in place, or by a restart); returns
        ``{"seconds": s, "mode": "in_place" | "restart"}``."""
        ...

    def sleep(self) -> None:
        """Free device memory, keep the process."""
        ...

    def close(self) -> None:
        """Stop whatever the engine started."""
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
