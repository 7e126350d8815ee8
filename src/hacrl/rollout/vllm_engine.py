"""vLLM as a rollout engine: vLLM in its own environment and process (:mod:`hacrl.rollout.vllm_worker`),
behind the same ``generate`` as :class:`hacrl.rollout.hf.HFEngine`."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hacrl.rollout.engine import Completion, EngineRequest, SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The vLLM worker failed or died; the message carries its last log lines."""


def ties_embeddings(model_dir: str | Path) -> bool:
    """Whether the checkpoint's input and output embeddings are one matrix. vLLM's in-place
    reload is exact only when they are not (measured: with tied embeddings the output silently
    diverges), so such an engine is restarted to serve new weights."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(model_dir), "tie_word_embeddings", False))


class VLLMEngine:
    """vLLM in its own environment and process (:mod:`hacrl.rollout.vllm_worker`), one model per engine.

    Started once and kept for as many ``generate`` calls as the caller makes; ``reload`` serves
    new weights (in place, or by a restart when the model ties its embeddings); ``close`` stops
    the process group. Prompts go in as the agent tokenizer's ids and completions come back as
    ids with their sampled log-probs after temperature; text is decoded here with the same
    tokenizer as :class:`HFEngine`, so records do not depend on the engine.
    """

    def __init__(self, model_dir: str | Path, tokenizer, python: str | Path, max_model_len: int,
                 dtype: str = "float32", seed: int = 0, threads: int = 2, kv_cache_gib: int = 1,
                 log_path: str | Path | None = None, timeout_s: float = 600.0,
                 gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
                 env: dict[str, str] | None = None, max_num_batched_tokens: int = 0, sleep_mode: bool = False):
        self.model_dir = str(model_dir)
        self.tokenizer = tokenizer
        self.python = str(python)
        self.max_model_len = int(max_model_len)
        self.dtype = dtype
        self.seed = seed
        self.threads = threads
        self.kv_cache_gib = kv_cache_gib
        self.timeout_s = timeout_s
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tensor_parallel_size = tensor_parallel_size
        self.extra_env = dict(env or {})
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.sleep_mode = bool(sleep_mode)
        self.asleep = False
        self.log_path = Path(log_path) if log_path else None
        self.proc = None
        self.startup_s = self._start()

    @classmethod
    def open(cls, request: EngineRequest) -> VLLMEngine:
        """A worker serving ``request.model_dir`` (``request.settings.vllm_python`` as resolved by
        the caller: the vLLM environment's interpreter)."""
        s = request.settings
        return cls(request.model_dir, request.tokenizer, python=s.vllm_python, max_model_len=request.max_model_len,
                   dtype=request.dtype, seed=request.seed, threads=request.threads, kv_cache_gib=s.vllm_kv_cache_gib,
                   timeout_s=s.vllm_timeout_s, gpu_memory_utilization=s.vllm_gpu_memory_utilization,
                   tensor_parallel_size=request.tensor_parallel_size, env=request.env,
                   max_num_batched_tokens=request.max_batch_tokens, sleep_mode=request.sleep_mode)

    # -- process
    def _start(self) -> float:
        import os
        import subprocess
        import tempfile

        if not Path(self.python).exists():
            raise EngineError(f"rollout.engine=vllm: no vLLM environment at {self.python} (run `make setup-vllm`)")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="hacrl-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE=str(max(1, int(self.kv_cache_gib))),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{max(0, self.threads - 1)}", OMP_NUM_THREADS=str(self.threads),
                   TOKENIZERS_PARALLELISM="false",
                   # the worker asks torch whether CUDA exists before vLLM forks its engine
                   # process: through NVML, so that CUDA itself is not initialised in the parent
                   PYTORCH_NVML_BASED_CUDA_CHECK="1")
        env.update(self.extra_env)  # the MWRA job's devices and cores
        for k in ("PYTHONPATH", "VIRTUAL_ENV"):  # the project's environment must not leak into vLLM's
            env.pop(k, None)
        self._log = open(self.log_path, "a")
        t0 = time.time()
        # -P: the worker's directory (this package) is not put on its sys.path, where a module
        # of ours could shadow one of vLLM's
        self.proc = subprocess.Popen([self.python, "-P", str(Path(__file__).with_name("vllm_worker.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, env=env, start_new_session=True)
        try:
            self._load()
        except BaseException:
            self.close(force=True)  # a worker whose load failed must not linger
            raise
        self.asleep = False
        return time.time() - t0

    def _load(self) -> None:
        self._call({"cmd": "load", "model": self.model_dir, "dtype": self.dtype,
                    "max_model_len": self.max_model_len, "seed": self.seed,
                    "gpu_memory_utilization": self.gpu_memory_utilization,
                    "tensor_parallel_size": self.tensor_parallel_size,
                    "max_num_batched_tokens": self.max_num_batched_tokens, "sleep_mode": self.sleep_mode})

    def _tail(self) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return ""

    def _call(self, req: dict) -> dict:
        import json
        import select

        if self.proc is None or self.proc.poll() is not None:
            raise EngineError(f"vLLM worker for {self.model_dir} is not running:\n{self._tail()}")
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close(force=True)
            why = "died" if ready else f"did not answer in {self.timeout_s:.0f}s"
            raise EngineError(f"vLLM worker for {self.model_dir} {why} ({req['cmd']}):\n{self._tail()}")
        out = json.loads(line)
        if not out.get("ok"):
            raise EngineError(f"vLLM worker ({req['cmd']}): {out.get('error')}\n{out.get('trace', '')}")
        return out

    def close(self, force: bool = False) -> None:
        """Stop the worker and everything it started (its process group)."""
        import os
        import signal
        import subprocess

        if self.proc is None:
            return
        if not force and self.proc.poll() is None:
            try:
                self._call({"cmd": "stop"})
                self.proc.wait(timeout=30)
            except (EngineError, subprocess.TimeoutExpired, OSError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # vLLM's engine core and its helpers
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sleep(self) -> None:
        """Free the device for an update and keep the process (vLLM sleep mode, GPU engines
        started with ``sleep_mode``); an engine without it stops. Wakes before the next request."""
        if not self.sleep_mode:
            self.close()
            return
        self._call({"cmd": "sleep"})
        self.asleep = True

    def wake(self) -> None:
        if self.proc is None:
            self._start()
        elif self.asleep:
            self._call({"cmd": "wake"})
        self.asleep = False

    # -- serving
    def reload(self, weights_dir: str | Path) -> dict:
        """Serve the weights in ``weights_dir`` (same architecture): vLLM's in-place reload, or a
        restart when the model ties its embeddings. Returns ``{"mode", "seconds"}``."""
        t0 = time.time()
        if self.asleep:
            self.wake()
        if self.proc is None or ties_embeddings(weights_dir):  # stopped (released), or tied
            self.close()
            self.model_dir = str(weights_dir)
            self._start()
            return {"mode": "restart", "seconds": time.time() - t0}
        self._call({"cmd": "reload", "weights": str(weights_dir)})
        self.model_dir = str(weights_dir)
        return {"mode": "in_place", "seconds": time.time() - t0}

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        import random

        if self.asleep or self.proc is None:  # released by an MWRA plan: serve again first
            self.wake()
        tok = self.tokenizer
        enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        rng = random.Random(params.seed)  # one sampling seed per prompt: reproducible for a given prompt list
        seeds = [rng.randrange(2**31 - 1) for _ in prompts]
        eos = tok.eos_token_id
        out = self._call({"cmd": "generate", "prompts": enc, "n": params.n, "temperature": params.temperature,
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
