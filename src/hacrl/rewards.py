"""Verifiable rewards: math-verify in killable worker processes.

math-verify's own timeouts use ``signal.alarm``: they fail outside a main thread and cannot
interrupt C-level bignum work. So every check runs in a worker process's main thread, and the
parent kills any worker that exceeds the per-answer limit and starts a fresh one: a hung check
is killed, never waited on. Identical (gold, response) pairs are checked once.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger(__name__)

CORRECT, WRONG, NO_ANSWER, TIMEOUT, GOLD_UNPARSEABLE = (
    "correct", "wrong", "no_answer", "timeout", "gold_unparseable")
VERDICTS = (CORRECT, WRONG, NO_ANSWER, TIMEOUT, GOLD_UNPARSEABLE)


def gold_expression(answer: str) -> str:
    """Gold answers are written as the text inside ``\\boxed{}``; math-verify reads them as LaTeX."""
    return f"$\\boxed{{{answer}}}$"


def check(gold: str, response: str, timeout_s: float = 5.0) -> str:
    """Verify one response against one gold answer (gold first; math-verify is not symmetric)."""
    from math_verify import parse, verify

    t = max(1, int(timeout_s))
    g = parse(gold_expression(gold), parsing_timeout=t)
    if not g:
        return GOLD_UNPARSEABLE
    p = parse(response, parsing_timeout=t)
    if not p:
        return NO_ANSWER
    return CORRECT if verify(g, p, timeout_seconds=t) else WRONG


def worker_main() -> None:
    """A verifier process: reads ``[key, gold, response]`` JSON lines, writes ``[key, verdict]``."""
    import json
    import logging as _logging
    import sys

    _logging.getLogger("math_verify").setLevel(_logging.CRITICAL)
    timeout_s = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    for line in sys.stdin:
        key, gold, response = json.loads(line)
        try:
            verdict = check(gold, response, timeout_s)
        except Exception:  # noqa: BLE001 - math-verify's own timeout or parse failure
            verdict = TIMEOUT
        sys.stdout.write(json.dumps([key, verdict]) + "\n")
        sys.stdout.flush()


WORKER_CODE = "from hacrl.rewards import worker_main; worker_main()"


class _Worker:
    """One verifier subprocess (independent of the caller's ``__main__``, killable at once)."""

    def __init__(self, timeout_s: float, code: str = WORKER_CODE):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)

    def send(self, key: int, gold: str, response: str) -> None:
        self.proc.stdin.write(json.dumps([key, gold, response]) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


class VerifierPool:
    """A pool of verifier processes with a hard per-answer time limit."""

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, worker_code: str = WORKER_CODE):
        self.worker_code = worker_code
        self.n = max(1, workers)
        self.timeout_s = timeout_s
        self.hard_limit = timeout_s * 1.5 + 1.0
        self.workers: list[_Worker] = []
        self.killed = 0

    def __enter__(self) -> "VerifierPool":
        self.workers = [_Worker(self.timeout_s, self.worker_code) for _ in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            w.close()
        self.workers = []

    def verify(self, pairs: list[tuple[str, str]], desc: str = "verify") -> list[str]:
        """Verdicts for ``(gold, response)`` pairs, in order."""
        unique = list(dict.fromkeys(pairs))
        verdict: dict[tuple[str, str], str] = {}
        todo = list(range(len(unique)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (task, start time)
        bar = tqdm(total=len(unique), desc=desc, leave=False, disable=len(unique) < 2000)
        while todo or busy:
            for slot, w in enumerate(self.workers):
                if slot not in busy and todo:
                    k = todo.pop()
                    try:
                        w.send(k, *unique[k])
                    except OSError:  # died while idle: replace and retry this task
                        self._replace(slot)
                        self.workers[slot].send(k, *unique[k])
                    busy[slot] = (k, time.monotonic())
            fds = {self.workers[s].proc.stdout: s for s in busy}
            ready, _, _ = select.select(list(fds), [], [], 0.1)
            for f in ready:
                s = fds[f]
                line = f.readline()
                if line:
                    k, v = json.loads(line)
                else:  # the worker died: its answer counts as a timeout
                    k, v = busy[s][0], TIMEOUT
                    self._replace(s)
                verdict[unique[k]] = v
                del busy[s]
                bar.update()
            now = time.monotonic()
            for s, (k, t0) in list(busy.items()):
                if now - t0 > self.hard_limit:
                    log.warning("verification exceeded %.1fs; killing its worker", self.hard_limit)
                    self._replace(s)
                    verdict[unique[k]] = TIMEOUT
                    del busy[s]
                    bar.update()
        bar.close()
        return [verdict[p] for p in pairs]

    def _replace(self, slot: int) -> None:
        self.workers[slot].kill()
        self.killed += 1
        self.workers[slot] = _Worker(self.timeout_s, self.worker_code)


def reward_of(verdict: str) -> float | None:
    """Binary reward; ``None`` means the sample is skipped (the gold answer does not parse)."""
    if verdict == GOLD_UNPARSEABLE:
        return None
    return 1.0 if verdict == CORRECT else 0.0
