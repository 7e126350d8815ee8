"""Engines whose model runs in a worker process: the worker's protocol and the session over it.

An engine of this kind has two halves. Its **worker** (a :class:`WorkerProcess`, named by the
engine table's row) owns a process serving one model: start, requests, weight reload, sleep,
stop. Its **session** (:class:`WorkerEngine`, subclassed per engine for ``generate``) is what a
stage holds: it starts a worker of its own, or, given ``request.host``, opens a session with the
workspace's engine host (:mod:`hacrl.rollout.engine_host`), which starts the row's worker and keeps
it across stages. Both answer the same calls, so a session never asks which it has; ``hosted``
says it, for the caller that decides what to keep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from hacrl.rollout.engine import EngineRequest


class WorkerProcess(Protocol):
    """A process serving one model, started from ``(model_dir, settings)``; what the engine host
    keeps per agent and a session drives. ``settings`` is plain data (the host compares it: a
    worker is reused only under the same settings)."""

    model_dir: str
    settings: dict
    opened: dict
    """What opening it took: ``{"mode": "start" | "reuse" | "in_place", "seconds", "startup_s"}``
    (``startup_s`` when a process started)."""
    asleep: bool

    def __init__(self, model_dir: str | Path, settings: dict, log_path: str | Path | None = None) -> None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def pid(self) -> int | None:
        """Its process (None: stopped)."""
        ...

    def call(self, req: dict) -> dict:
        """One request to the worker, its reply (raises ``EngineError`` when it failed or died)."""
        ...

    def reload(self, weights_dir: str | Path) -> dict:
        """Serve other weights (in place, or a restart of a stopped worker): ``{"mode", "seconds"}``."""
        ...

    def sleep(self) -> None:
        """Free the device and keep the process where the worker can; else stop."""
        ...

    def wake(self) -> None:
        """Serve again after a sleep or a stop."""
        ...

    def stop(self) -> None:
        """Stop the worker (a hosted session: the host's worker too)."""
        ...

    def close(self, force: bool = False) -> None:
        """End: an own worker stops; a hosted session ends and the host keeps the worker."""
        ...


class WorkerEngine:
    """The session half of an engine with a worker process (subclasses add ``generate`` and
    ``open``, which turns a request into the worker's settings and calls :meth:`start_worker`).

    ``worker``: the engine's :class:`WorkerProcess` class; the engine host starts it too (it
    imports the engine class the session names and takes its ``worker``).
    """

    worker: type

    def __init__(self, proc: WorkerProcess, tokenizer, hosted: bool):
        self.proc = proc
        self.tokenizer = tokenizer
        self.hosted = hosted
        opened = proc.opened
        started = opened.get("startup_s")
        self.cost: dict[str, float] = {} if started is None else {"engine_startup_s": round(started, 2)}
        if hosted:  # the engine host's worker: started, reused, or reloaded in place
            self.cost.update({"engine_sync_s": round(opened["seconds"], 2), "engine_hosted": 1,
                              "engine_reused": int(opened["mode"] == "reuse"),
                              "engine_started": int(opened["mode"] == "start")})

    @classmethod
    def start_worker(cls, request: EngineRequest, settings: dict) -> tuple[WorkerProcess, bool]:
        """The session's worker under ``settings``: the engine host's for ``request.agent`` at
        ``request.weights_id`` when ``request.host`` is set, else one of its own."""
        if request.host is not None:
            from hacrl.rollout.engine_host import HostedProcess

            return HostedProcess(request.host, request.agent, request.model_dir, request.weights_id, settings,
                                 request.host_idle_s, engine=request.engine,
                                 entry=f"{cls.__module__}:{cls.__qualname__}"), True
        return cls.worker(request.model_dir, settings), False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serving(self) -> WorkerProcess:
        """The worker, made to serve again first if a release put it to sleep or stopped it."""
        if self.proc.asleep or not self.proc.alive:
            self.proc.wake()
        return self.proc

    def load_weights(self, weights_dir: str | Path) -> dict:
        """Serve the weights in ``weights_dir`` (same architecture). Returns ``{"mode", "seconds"}``."""
        return self.proc.reload(weights_dir)

    def release(self, action: str) -> None:
        """``sleep``: free the device, keep the worker (where it was started able to; else it
        stops); ``stop``: stop the worker, the engine host's included."""
        if action == "sleep":
            self.proc.sleep()
        else:
            self.proc.stop()

    def close(self) -> None:
        """Stop the worker (or end the session with the engine host, which keeps it)."""
        self.proc.close()
