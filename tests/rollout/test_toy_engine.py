"""A new out-of-process rollout engine, added in this one file: what the engine interface promises.

The toy engine runs transformers ``generate`` in a worker process of its own (this file, run as
a script), behind :class:`hacrl.rollout.worker_engine.WorkerEngine`. Registered as a row of the
engine table, it runs generate-rollouts like any engine: on its own worker in an in-process run,
and on the engine host's in a stage process, where the host starts the worker the row's class
names, reuses it for the same checkpoint, and stops it on a release. Its rollouts are the
transformers engine's, record for record (the same model, seeds and batches, in another process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hacrl.rollout.engine import Completion, EngineError, EngineRequest, SamplingParams
from hacrl.rollout.worker_engine import WorkerEngine


class ToyProcess:
    """The worker: this file as a script, JSON lines over its pipes."""

    def __init__(self, model_dir, settings: dict, log_path=None):
        self.model_dir, self.settings = str(model_dir), dict(settings)
        self.asleep = False
        self.proc = None
        self.opened = {"mode": "start", "seconds": 0.0, "startup_s": self._start()}

    def _start(self) -> float:
        import time

        t0 = time.time()
        self.proc = subprocess.Popen([sys.executable, __file__, "--toy-worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.call({"cmd": "load", "model": self.model_dir, **self.settings})
        return time.time() - t0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    def call(self, req: dict) -> dict:
        if not self.alive:
            raise EngineError("toy worker is not running")
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline() or '{"ok": false, "error": "died"}')
        if not out.get("ok"):
            raise EngineError(f"toy worker: {out.get('error')}")
        return out

    def reload(self, weights_dir) -> dict:
        self.model_dir = str(weights_dir)
        if not self.alive:
            self._start()
            return {"mode": "restart", "seconds": 0.0}
        self.call({"cmd": "load", "model": self.model_dir, **self.settings})
        return {"mode": "in_place", "seconds": 0.0}

    def sleep(self) -> None:  # no sleep mode: a release stops it
        self.close()

    def wake(self) -> None:
        if not self.alive:
            self._start()

    def stop(self) -> None:
        self.close()

    def close(self, force: bool = False) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class ToyEngine(WorkerEngine):
    worker = ToyProcess

    @classmethod
    def open(cls, request: EngineRequest) -> ToyEngine:
        settings = {"dtype": request.dtype, "batch_size": request.batch_size, "threads": request.threads}
        proc, hosted = cls.start_worker(request, settings)
        return cls(proc, request.tokenizer, hosted)

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        out = self.serving().call({"cmd": "generate", "prompts": prompts, "params": dataclasses.asdict(params)})
        return [Completion(**c) for c in out["completions"]]


def _worker() -> None:
    """The toy worker's loop: load, generate with transformers (HFEngine), reload."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hacrl.rollout.hf import HFEngine

    engine = None
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "load":
            torch.set_num_threads(req["threads"])
            model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=getattr(torch, req["dtype"]))
            tok = AutoTokenizer.from_pretrained(req["model"])
            tok.pad_token = tok.pad_token or tok.eos_token  # as every stage loads it
            engine = HFEngine(model, tok, batch_size=req["batch_size"])
            out = {"ok": True}
        else:
            comps = engine.generate(req["prompts"], SamplingParams(**req["params"]))
            out = {"ok": True, "completions": [dataclasses.asdict(c) for c in comps]}
        print(json.dumps(out), flush=True)


TOY = "toy"


@pytest.fixture
def toy_row(monkeypatch):
    from hacrl.rollout.table import ENGINES, EngineSpec

    # the one line a new engine adds to rollout/table.py
    monkeypatch.setitem(ENGINES, TOY, EngineSpec(TOY, f"{__name__}:ToyEngine", in_process=False,
                                                 exact_logprobs=False, keeps_alive=True, can_sleep=False,
                                                 hostable=True))
    # the engine host imports the row's class from this file (a real engine's module is the package's)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))


def _records(cfg, t=1):
    from hacrl.exchange.experience import read_records
    from hacrl.storage import RunLayout

    lay = RunLayout(cfg.experiment.runs_dir)
    cols = ["record_id", "response_token_ids", "response_logprobs", "finish_reason"]
    return {a.name: read_records(lay.rollouts(t) / f"{a.name}.parquet", "rollout")[cols] for a in cfg.agents}


def test_a_toy_out_of_process_engine_generates_like_the_in_process_one(toy_row, workspaces):
    import pandas as pd

    from hacrl.pipeline import table

    hf = workspaces.iteration("toy-hf", until="verify-rewards")
    toy = workspaces.iteration("toy-own", f"rollout.engine={TOY}", until="verify-rewards")
    for name, df in _records(hf).items():
        pd.testing.assert_frame_equal(_records(toy)[name], df, check_exact=True)
    # an in-process run keeps it across iterations and loads the next checkpoint into it
    live: dict = {}
    try:
        with workspaces.inside():
            first = table.run("generate-rollouts", toy, 1, live=live)
            kept = dict(live)
            again = table.run("generate-rollouts", toy, 1, live=live)
        assert set(live) == {a.name for a in toy.agents} and all(e.proc.alive for e in live.values())
        for a in toy.agents:
            assert first[a.name]["engine_startup_s"] > 0 and "engine_sync_s" not in first[a.name]
            assert live[a.name] is kept[a.name] and again[a.name]["engine_sync_restart"] == 0  # loaded in place
        for name, df in _records(hf).items():  # the kept worker's rollouts are still the same
            pd.testing.assert_frame_equal(_records(toy)[name], df, check_exact=True)
    finally:
        for e in live.values():
            e.close()


def test_the_engine_host_keeps_a_toy_worker_and_stops_it_on_a_release(toy_row, workspaces):
    from hacrl.pipeline import table
    from hacrl.pipeline.stage_engines import serve_from_host
    from hacrl.rollout import engine_host

    cfg = workspaces.iteration("toy-hosted", f"rollout.engine={TOY}", until="generate-rollouts")
    serve_from_host(True)
    try:
        with workspaces.inside():
            first = table.run("generate-rollouts", cfg, 1)
            second = table.run("generate-rollouts", cfg, 1)
            host = engine_host.status(Path.cwd())
            for a in cfg.agents:
                assert first[a.name]["engine_hosted"] == 1 and first[a.name]["engine_started"] == 1
                assert second[a.name]["engine_reused"] == 1  # the same checkpoint: the same worker
            assert {e["engine"] for e in host["engines"]} == {TOY} and len(host["engines"]) == len(cfg.agents)
            # a release that frees the device stops the host's worker, not only the session
            from hacrl.pipeline.stage_engines import StageEngines
            from hacrl.resources import Release

            with StageEngines(cfg) as engines:
                ac = cfg.agents[0]
                from hacrl.agents.pool import load_agent
                from hacrl.storage import RunLayout

                ckpt = RunLayout(cfg.experiment.runs_dir).checkpoint(0, ac.name)
                engine = engines.open(ac, load_agent(ac, ckpt), ckpt)
                engines.done(ac.name, engine)
                engines.release(Release(0, ac.name, "stop", ("cpu",)))
            left = {e["agent"] for e in engine_host.status(Path.cwd())["engines"]}
            assert left == {a.name for a in cfg.agents[1:]}
    finally:
        serve_from_host(False)
        with workspaces.inside():
            engine_host.stop(Path.cwd())


if __name__ == "__main__" and sys.argv[1:] == ["--toy-worker"]:
    _worker()
