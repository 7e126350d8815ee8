"""vLLM as a rollout engine: vLLM in its own environment and process (:mod:`hacrl.rollout.vllm_worker`),
behind the same session as :class:`hacrl.rollout.hf.HFEngine`.

Two halves (:mod:`hacrl.rollout.worker_engine`): :class:`VLLMProcess` owns a worker process (start,
requests, weight reload, sleep, stop), the ``vllm`` row's worker that the engine host keeps;
:class:`VLLMEngine` is the session a stage holds (tokenising, per-prompt seeds, decoding) over its
own worker or the host's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hacrl.config.build import CONF_DIR
from hacrl.rollout.engine import Completion, EngineError, EngineRequest, SamplingParams
from hacrl.rollout.worker_engine import WorkerEngine

log = logging.getLogger(__name__)


class VLLMProcess:
    """One vLLM worker process serving one model (:mod:`hacrl.rollout.vllm_worker`).

    ``settings``: how it runs (the keys of :meth:`settings_of`); a process is reused only for the
    same settings. ``reload`` serves new weights in place (vLLM's reload, a tied output head
    rebuilt: bit for bit a fresh load, ``tests/rollout/test_vllm.py``); ``sleep`` frees the device and
    keeps the process (GPU engines started with ``sleep_mode``); ``close`` stops its group.
    """

    def __init__(self, model_dir: str | Path, settings: dict, log_path: str | Path | None = None):
        self.model_dir = str(model_dir)
        self.settings = dict(settings)
        self.asleep = False
        self.log_path = Path(log_path) if log_path else None
        self.proc = None
        self._log = None
        started = self._start()
        self.opened = {"mode": "start", "seconds": started, "startup_s": started}

    @staticmethod
    def settings_of(python, max_model_len: int, dtype: str = "float32", seed: int = 0, threads: int = 2,
                    kv_cache_gib: int = 1, timeout_s: float = 600.0, gpu_memory_utilization: float = 0.9,
                    tensor_parallel_size: int = 1, env: dict[str, str] | None = None,
                    max_num_batched_tokens: int = 0, sleep_mode: bool = False) -> dict:
        """Everything that decides how a worker runs, as plain data (the engine host compares it)."""
        return {"python": str(python), "max_model_len": int(max_model_len), "dtype": dtype, "seed": int(seed),
                "threads": int(threads), "kv_cache_gib": int(kv_cache_gib), "timeout_s": float(timeout_s),
                "gpu_memory_utilization": float(gpu_memory_utilization),
                "tensor_parallel_size": int(tensor_parallel_size), "env": dict(sorted((env or {}).items())),
                "max_num_batched_tokens": int(max_num_batched_tokens), "sleep_mode": bool(sleep_mode)}

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _start(self) -> float:
        import os
        import subprocess
        import tempfile

        st = self.settings
        if not Path(st["python"]).exists():
            raise EngineError(f"rollout.engine=vllm: no vLLM environment at {st['python']} (run `make setup-vllm`)")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="hacrl-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        threads = int(st["threads"])
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE=str(max(1, int(st["kv_cache_gib"]))),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{max(0, threads - 1)}", OMP_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false",
                   # vLLM's engine core in the worker's own process: in its own process it starts
                   # scheduling while a generate call's requests still arrive, so a loaded machine
                   # batched them otherwise and the log-probs moved in the last bits (seen here:
                   # 1.3e-5 on a fresh worker started under load); in process, every request of
                   # the call is queued before the first step
                   VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   # the worker asks torch whether CUDA exists before vLLM forks its engine
                   # process: through NVML, so that CUDA itself is not initialised in the parent
                   PYTORCH_NVML_BASED_CUDA_CHECK="1")
        env.update(st["env"])  # the MWRA job's devices and cores
        env.pop("VIRTUAL_ENV", None)  # the project's environment must not leak into vLLM's
        # only the worker extension's own directory (a module name nothing else uses)
        env["PYTHONPATH"] = str(Path(__file__).with_name("vllm_ext"))
        self._log = open(self.log_path, "a")
        t0 = time.time()
        # -P: the worker's directory (this package) is not put on its sys.path, where a module
        # of ours could shadow one of vLLM's
        self.proc = subprocess.Popen([st["python"], "-P", str(Path(__file__).with_name("vllm_worker.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, env=env, start_new_session=True)
        try:
            self.call({"cmd": "load", "model": self.model_dir, "dtype": st["dtype"],
                       "max_model_len": st["max_model_len"], "seed": st["seed"],
                       "gpu_memory_utilization": st["gpu_memory_utilization"],
                       "tensor_parallel_size": st["tensor_parallel_size"],
                       "max_num_batched_tokens": st["max_num_batched_tokens"], "sleep_mode": st["sleep_mode"]})
        except BaseException:
            self.close(force=True)  # a worker whose load failed must not linger
            raise
        self.asleep = False
        return time.time() - t0

    def _tail(self) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return ""

    def call(self, req: dict) -> dict:
        """One request, its reply (raises :class:`EngineError` if the worker failed or died)."""
        import json
        import select

        if not self.alive:
            raise EngineError(f"vLLM worker for {self.model_dir} is not running:\n{self._tail()}")
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: the read below says so
        timeout_s = float(self.settings["timeout_s"])
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close(force=True)
            why = "died" if ready else f"did not answer in {timeout_s:.0f}s"
            raise EngineError(f"vLLM worker for {self.model_dir} {why} ({req['cmd']}):\n{self._tail()}")
        out = json.loads(line)
        if not out.get("ok"):
            raise EngineError(f"vLLM worker ({req['cmd']}): {out.get('error')}\n{out.get('trace', '')}")
        return out

    def reload(self, weights_dir: str | Path) -> dict:
        """Serve the weights in ``weights_dir`` (same architecture): in place, or a fresh start if
        the process was stopped. Returns ``{"mode", "seconds"}``."""
        t0 = time.time()
        if not self.alive:
            self.close(force=True)
            self.model_dir = str(weights_dir)
            self._start()
            return {"mode": "restart", "seconds": time.time() - t0}
        if self.asleep:
            self.wake()
        self.call({"cmd": "reload", "weights": str(weights_dir)})
        self.model_dir = str(weights_dir)
        return {"mode": "in_place", "seconds": time.time() - t0}

    def sleep(self) -> None:
        """Free the device for an update and keep the process (vLLM sleep mode, GPU engines
        started with ``sleep_mode``); one without it stops. Wakes before the next request."""
        if not self.settings["sleep_mode"]:
            self.close()
            return
        self.call({"cmd": "sleep"})
        self.asleep = True

    def wake(self) -> None:
        if not self.alive:
            self.close(force=True)
            self._start()
        elif self.asleep:
            self.call({"cmd": "wake"})
        self.asleep = False

    def stop(self) -> None:
        """Stop the worker (an MWRA release that frees the device)."""
        self.close()

    def close(self, force: bool = False) -> None:
        """Stop the worker and everything it started (its process group)."""
        import os
        import signal
        import subprocess

        if self.proc is None:
            return
        if not force and self.proc.poll() is None:
            try:
                self.call({"cmd": "stop"})
                self.proc.wait(timeout=30)
            except (EngineError, subprocess.TimeoutExpired, OSError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # vLLM's engine core and its helpers
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


class VLLMEngine(WorkerEngine):
    """vLLM behind the rollout engine session, one model per engine.

    Started once and kept for as many ``generate`` calls as the caller makes; ``load_weights``
    serves new weights in place; ``close`` stops the worker (or, hosted, ends the session with
    the engine host, which keeps it). Prompts go in as the agent tokenizer's ids and completions
    come back as ids with their sampled log-probs after temperature; text is decoded here with
    the same tokenizer as :class:`HFEngine`, so records do not depend on the engine.
    """

    worker = VLLMProcess

    @classmethod
    def local(cls, model_dir: str | Path, tokenizer, python: str | Path, max_model_len: int,
              dtype: str = "float32", seed: int = 0, threads: int = 2, kv_cache_gib: int = 1,
              timeout_s: float = 600.0, gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
              env: dict[str, str] | None = None, max_num_batched_tokens: int = 0,
              sleep_mode: bool = False) -> VLLMEngine:
        """A session on a worker of its own, from plain arguments (scripts and tests)."""
        settings = VLLMProcess.settings_of(python, max_model_len, dtype, seed, threads, kv_cache_gib, timeout_s,
                                           gpu_memory_utilization, tensor_parallel_size, env,
                                           max_num_batched_tokens, sleep_mode)
        return cls(VLLMProcess(model_dir, settings), tokenizer, hosted=False)

    @classmethod
    def open(cls, request: EngineRequest) -> VLLMEngine:
        """A session serving ``request.model_dir`` under ``request.settings`` (``engines.vllm``),
        on the engine host's worker if ``request.host``."""
        s = request.settings
        env = dict(request.env or {})
        threads = s.threads or request.threads
        if request.cores is not None:  # a cpu:N share: bind the job's own cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{request.cores[0]}-{request.cores[0] + request.cores[1] - 1}"
        settings = VLLMProcess.settings_of(
            vllm_python(s.python), max_model_len(s.max_model_len, request.model), request.dtype, request.seed, threads,
            s.kv_cache_gib, s.timeout_s, s.gpu_memory_utilization, request.tensor_parallel_size, env,
            request.max_batch_tokens, request.sleep_mode)
        proc, hosted = cls.start_worker(request, settings)
        return cls(proc, request.tokenizer, hosted)

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        import random

        tok = self.tokenizer
        enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        rng = random.Random(params.seed)  # one sampling seed per prompt: reproducible for a given prompt list
        seeds = [rng.randrange(2**31 - 1) for _ in prompts]
        eos = tok.eos_token_id
        out = self.serving().call({"cmd": "generate", "prompts": enc, "n": params.n, "temperature": params.temperature,
                              "top_p": params.top_p, "max_tokens": params.max_new_tokens, "greedy": params.greedy,
                              "seeds": seeds, "stop_token_ids": [eos] if eos is not None else []})["outputs"]
        results = []
        for pi, comps in enumerate(out):
            for si, c in enumerate(comps if not params.greedy else comps * params.n):
                ids, lps = list(c["token_ids"]), list(c["logprobs"])
                finish = "length"
                if eos in ids:
                    cut = ids.index(eos) + 1
                    ids, lps, finish = ids[:cut], lps[:cut], "stop"
                text = tok.decode(ids, skip_special_tokens=True)
                results.append(Completion(pi, si, text, enc[pi], ids, lps, finish))
        return results


def max_model_len(configured: int, model) -> int:
    """Prompt + response tokens a worker serves: ``engines.vllm.max_model_len``, else the model's
    ``max_position_embeddings`` (at most 4096)."""
    return configured or min(4096, int(getattr(getattr(model, "config", None), "max_position_embeddings", None)
                                       or 4096))


def vllm_python(path: str | Path) -> Path:
    """The vLLM interpreter: an absolute path as is; a relative one from the working directory if
    it exists there, else from the project root (where ``make setup-vllm`` builds it)."""
    p = Path(path)
    if p.is_absolute() or (Path.cwd() / p).exists():
        return p.absolute()
    return CONF_DIR.parent / p
