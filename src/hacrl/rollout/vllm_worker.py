"""The vLLM side of ``rollout.engine: vllm``: one process serving one model, in vLLM's own
environment (``make setup-vllm``; vLLM pins its own torch and transformers).

Run by :class:`hacrl.rollout.vllm_engine.VLLMEngine` as ``<vllm python> vllm_worker.py``. It imports nothing
from hacrl: the project's environment and vLLM's never meet in one interpreter. Requests and
replies are JSON lines on stdin / stdout, and vLLM's own logging goes to stderr. So no port is
opened, and nothing listens.

Requests:
- ``{"cmd": "load", "model": DIR, "dtype": ..., "max_model_len": N, "seed": S,
  "gpu_memory_utilization": F, "tensor_parallel_size": K}``
- ``{"cmd": "generate", "prompts": [[ids]], "n": ..., "temperature": ..., "top_p": ...,
  "max_tokens": ..., "greedy": bool, "seeds": [per prompt], "stop_token_ids": [...]}``
  returns, per prompt, n ``{"token_ids", "logprobs", "finish_reason"}``.
- ``{"cmd": "reload", "weights": DIR}``: in place (``hacrl_vllm_ext``: vLLM's reload, then a tied
  output head rebuilt from the reloaded embedding), then ``reset_prefix_cache``; replies with
  the number of heads rebuilt.
- ``{"cmd": "stop"}``

Log-probs: ``logprobs_mode="processed_logprobs"``, the sampled token's log-prob under the
distribution it was drawn from, after temperature. That is the trainer's
``log_softmax(logits / T)`` when top-p is 1, as in training.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

_OUT = None


def _reply(obj: dict) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def main() -> int:
    global _OUT
    # replies go to a private copy of stdout; fd 1 itself (inherited by vLLM's engine process,
    # whose logging writes to stdout) is pointed at stderr so that nothing else reaches the pipe
    _OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    llm = None
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req.get("cmd")
        t0 = time.time()
        try:
            if cmd == "load":
                from vllm import LLM

                extra = {}
                if req.get("sleep_mode"):  # GPU only: sleep() moves the weights off the device
                    extra["enable_sleep_mode"] = True
                budget = int(req.get("max_num_batched_tokens") or 0)
                import torch

                if not torch.cuda.is_available():
                    # a prompt prefilled in chunks has its sampled token discarded and its seeded
                    # generator rewound, which CPU generators cannot do (measured: "CPU Generator
                    # does not use offset" once a batch's prompts exceed the token budget); whole
                    # prefills need a budget of at least one full sequence
                    extra["enable_chunked_prefill"] = False
                    budget = max(budget, int(req["max_model_len"]))
                if budget > 0:
                    extra["max_num_batched_tokens"] = budget
                llm = LLM(model=req["model"], tokenizer=req["model"], dtype=req.get("dtype", "float32"),
                          max_model_len=int(req["max_model_len"]), seed=int(req.get("seed", 0)),
                          enforce_eager=True, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
                          enable_prefix_caching=False,
                          gpu_memory_utilization=float(req.get("gpu_memory_utilization", 0.9)),
                          tensor_parallel_size=int(req.get("tensor_parallel_size", 1)),
                          worker_extension_cls="hacrl_vllm_ext.HacrlWorkerExtension", **extra)
                _reply({"ok": True, "seconds": time.time() - t0})
            elif cmd == "generate":
                from vllm import SamplingParams
                from vllm.inputs import TokensPrompt

                prompts = req["prompts"]
                seeds = req.get("seeds") or [None] * len(prompts)
                greedy = bool(req.get("greedy"))
                params = [SamplingParams(n=1 if greedy else int(req["n"]),
                                         temperature=0.0 if greedy else float(req["temperature"]),
                                         top_p=1.0 if greedy else float(req["top_p"]), top_k=0 if greedy else -1,
                                         max_tokens=int(req["max_tokens"]), seed=s, logprobs=0, detokenize=False,
                                         stop_token_ids=list(req.get("stop_token_ids") or []))
                          for s in seeds]
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                res = []
                for o in outs:
                    comps = []
                    for c in o.outputs:
                        ids = list(c.token_ids)
                        lps = [float(d[t].logprob) if d is not None and t in d else float("nan")
                               for t, d in zip(ids, c.logprobs or [None] * len(ids))]
                        comps.append({"token_ids": ids, "logprobs": lps, "finish_reason": c.finish_reason})
                    res.append(comps)
                _reply({"ok": True, "outputs": res, "seconds": time.time() - t0})
            elif cmd == "reload":
                rebuilt = llm.collective_rpc("hacrl_reload", kwargs={"weights_path": req["weights"]})
                llm.reset_prefix_cache()
                _reply({"ok": True, "seconds": time.time() - t0, "tied_heads": rebuilt[0]})
            elif cmd == "sleep":  # level 1: weights to host memory, KV cache dropped
                llm.sleep(level=1)
                _reply({"ok": True, "seconds": time.time() - t0})
            elif cmd == "wake":
                llm.wake_up()
                _reply({"ok": True, "seconds": time.time() - t0})
            elif cmd == "stop":
                _reply({"ok": True})
                return 0
            else:
                _reply({"ok": False, "error": f"unknown command {cmd!r}"})
        except Exception as e:  # the client raises it with the traceback's tail
            _reply({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
