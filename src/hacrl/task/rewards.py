"""Verifiable rewards: math-verify in killable worker processes.

math-verify's own timeouts use ``signal.alarm``: they fail outside a main thread and cannot
interrupt C-level bignum work. So every check runs in a worker process's main thread, and the
parent kills any worker whose current check runs past ``timeout_s + 1`` seconds and starts a
fresh one: a hung check is killed, never waited on. Identical (gold, response) pairs are checked
once.

An answer whose verdict the strings alone decide is not sent to a worker (``fast_verdict``): a
canonical integer gold (at most 12 digits) against a response that is exactly ``\\boxed{N}``
for a canonical integer N. math-verify compares two integers exactly (no float tolerance: that
applies only when one side is a float), so its verdict is "correct" iff the digit strings are
equal; ``tests/task/test_rewards.py`` checks the agreement on a corpus of such pairs. Anything else,
or ``reward.fast_path: false``, goes to math-verify. Workers start when the first answer needs
one, so a call the fast path settles pays no math-verify import.

Throughput (``hacrl bench verify``, docs/BENCHMARKS.md): each worker keeps several answers
outstanding (a pipeline), so it never idles on a round trip to the parent, and takes them in runs
of consecutive ones, so a prompt's samples meet the same caches; it imports math-verify before
it reads its first answer and says so, so the import is not charged to any answer's time limit;
it reuses parsed gold answers and keeps more of math-verify's LaTeX conversions. Every other verdict is
still ``verdict()``'s, computed by math-verify in a worker.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import time
from collections import deque

from hacrl.config.schema import RewardConfig

log = logging.getLogger(__name__)

CORRECT, WRONG, NO_ANSWER, TIMEOUT, GOLD_UNPARSEABLE = (
    "correct", "wrong", "no_answer", "timeout", "gold_unparseable")
VERDICTS = (CORRECT, WRONG, NO_ANSWER, TIMEOUT, GOLD_UNPARSEABLE)

DEFAULT = RewardConfig()
"""``reward``'s defaults (config/schema.py), for callers that pass none (scripts, benchmarks)."""

KILL_GRACE_S = 1.0
"""A check is killed this long after its ``timeout_s``: math-verify's alarms end every
interruptible check within ``timeout_s`` per phase; what is left is C-level work."""
PIPELINE_DEPTH = 8
"""Answers outstanding per worker: enough to cover the parent's latency on a loaded 2-core host,
few enough that the answers queued behind a slow check wait little (they are re-queued if it
is killed)."""
RUN_LENGTH = 32
"""Consecutive answers a worker takes at a time (a few prompts' samples)."""
PIPELINE_BYTES = 32 * 1024
"""At most this many bytes outstanding per worker (unless it has none), half a Linux pipe: a
write to a worker's stdin then never blocks while that worker is busy."""
STARTUP_LIMIT_S = 120.0
"""A worker that has not imported math-verify after this long is a broken setup, not a slow answer."""
GOLD_CACHE = 4096
"""Parsed gold answers a worker keeps (a few MiB)."""
LATEX_CACHE = 4096
"""LaTeX conversions math-verify keeps in a worker (its own default: 20)."""
READY = "ready"
"""The line a worker writes once it can check answers (before it reads any)."""


_INT = r"(?:0|-?[1-9][0-9]{0,11})"
_GOLD_INT = re.compile(_INT)
_BOXED_INT = re.compile(r"\s*\\boxed\{(" + _INT + r")\}\s*")


def fast_verdict(gold: str, response: str) -> str | None:
    """math-verify's verdict where the strings decide it, else ``None`` (ask math-verify).

    Decided: ``gold`` is a canonical integer (no sign on 0, no leading zeros, at most 12 digits)
    and ``response`` is exactly ``\\boxed{N}`` (whitespace around it allowed) with N a canonical
    integer: both parse to sympy Integers, which math-verify compares exactly, and their strings
    are equal iff the integers are.
    """
    if _GOLD_INT.fullmatch(gold):
        m = _BOXED_INT.fullmatch(response)
        if m:
            return CORRECT if m.group(1) == gold else WRONG
    return None


def gold_expression(answer: str) -> str:
    """Gold answers are written as the text inside ``\\boxed{}``; math-verify reads them as LaTeX."""
    return f"$\\boxed{{{answer}}}$"


class _Timeouts(logging.Handler):
    """Counts math-verify's own timeouts. It catches them itself and returns "nothing parsed"
    or "not equal", saying so only in a warning ("Timeout during parsing/comparison"); a check
    that met one is a ``timeout``, not a ``no_answer`` or ``wrong``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Timeout during"):
            self.hits += 1


_TIMEOUTS: _Timeouts | None = None


def _timeouts() -> _Timeouts:
    """The counter, on the loggers math-verify reports its timeouts with (their warnings are
    counted, not printed). Their own level is set, so a quieter ``math_verify`` parent logger
    (a caller silencing it) does not hide a timeout."""
    global _TIMEOUTS
    if _TIMEOUTS is None:
        _TIMEOUTS = _Timeouts()
        for name in ("math_verify.parser", "math_verify.grader"):
            lg = logging.getLogger(name)
            lg.addHandler(_TIMEOUTS)
            lg.setLevel(logging.WARNING)
            lg.propagate = False
    return _TIMEOUTS


def verdict(gold: str, response: str, timeout_s: float = DEFAULT.timeout_s, golds: dict[str, list] | None = None) -> str:
    """Verify one response against one gold answer (gold first; math-verify is not symmetric).

    ``golds``: parsed gold answers to reuse (a worker keeps one; samples of a prompt share their
    gold). The verdict is the same with or without it: math-verify's ``parse`` is a function of
    its text, its results are immutable sympy objects (and strings) that ``verify`` only reads,
    and math-verify reuses them itself (``parse_latex_cached`` is an ``lru_cache`` over the same
    strings). Only a parse whose LaTeX converted is kept: one cut short by its alarm returns
    ``[]``, one that failed inside (math-verify swallows the exception) only the fallback
    string, and both are parsed afresh next time, as without the cache.
    """
    from math_verify import parse, verify

    t = max(1, int(timeout_s))
    clock = _timeouts()
    before = clock.hits
    g = golds.get(gold) if golds is not None else None
    if g is None:
        g = parse(gold_expression(gold), parsing_timeout=t)
        if golds is not None and _converted(g):
            if len(golds) >= GOLD_CACHE:
                del golds[next(iter(golds))]  # the oldest: the samples of one prompt come together
            golds[gold] = g
    if clock.hits > before:
        return TIMEOUT
    if not g or (not _converted(g) and not _balanced(gold)):
        # nothing parsed, or only math-verify's fallback string of malformed LaTeX (``\frac{``):
        # no gold to compare with. A text gold (``12\%``) keeps math-verify's string comparison.
        return GOLD_UNPARSEABLE
    p = parse(response, parsing_timeout=t)
    if clock.hits > before:
        return TIMEOUT
    if not p:
        return NO_ANSWER
    if verify(g, p, timeout_seconds=t):
        return CORRECT
    return TIMEOUT if clock.hits > before else WRONG


def _balanced(text: str) -> bool:
    """Whether the braces of ``text`` (not counting escaped ones) pair up."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "{}" and (i == 0 or text[i - 1] != "\\"):
            depth += 1 if ch == "{" else -1
            if depth < 0:
                return False
    return depth == 0


def _converted(parsed: list) -> bool:
    from sympy import Basic, MatrixBase

    return any(isinstance(x, (Basic, MatrixBase)) for x in parsed)


def _widen_latex_cache(size: int) -> None:
    """Let math-verify keep ``size`` LaTeX conversions instead of 20.

    Converting LaTeX to sympy (ANTLR) is most of a check, and math-verify already memoises it:
    ``parse_latex_cached`` is an ``lru_cache`` over the normalised LaTeX string, of a function of
    that string alone. A worker sees the same strings again and again (``\\boxed{12}`` and
    ``The answer is $12$.`` both come down to ``12``), far more than 20 apart. Same function,
    same results (a conversion that raised, e.g. cut short by its alarm, is not memoised by an
    ``lru_cache``), only a longer memory; left alone if math-verify no longer has it.
    """
    from functools import lru_cache

    from math_verify import parser

    cached = getattr(parser, "parse_latex_cached", None)
    if hasattr(cached, "cache_info") and hasattr(cached, "__wrapped__"):
        parser.parse_latex_cached = lru_cache(maxsize=size)(cached.__wrapped__)


def worker_main() -> None:
    """A verifier process: says :data:`READY` once math-verify is imported, then reads
    ``[key, gold, response]`` JSON lines and writes ``[key, verdict]`` lines, in order."""
    import math_verify  # noqa: F401 - imported before the first answer, not charged to it

    _timeouts()  # math-verify's warnings: its timeouts counted, nothing printed
    _widen_latex_cache(LATEX_CACHE)
    timeout_s = float(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT.timeout_s
    golds: dict[str, list] = {}
    out = sys.stdout
    out.write(json.dumps(READY) + "\n")
    out.flush()
    for line in sys.stdin:
        key, gold, response = json.loads(line)
        try:
            v = verdict(gold, response, timeout_s, golds)
        except Exception:  # noqa: BLE001 - math-verify's own timeout or parse failure
            v = TIMEOUT
        out.write(json.dumps([key, v]) + "\n")
        out.flush()
    # nothing is left to write: skip the interpreter's teardown of sympy's objects (a third of a
    # second the parent would wait for at the end of every stage)
    os._exit(0)


WORKER_CODE = "from hacrl.task.rewards import worker_main; worker_main()"


def worker_command(timeout_s: float, code: str = WORKER_CODE) -> list[str]:
    """How a verifier process is started (here, or ahead of time by the engine host)."""
    return [sys.executable, "-c", code, str(timeout_s)]


def worker_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


class _LentProcess:
    """A verifier process another process started (the engine host) and handed over: its pid and
    the two ends of its pipes. What :class:`_Worker` uses of ``subprocess.Popen``, through a
    pidfd (it is not this process's child: the host reaps it)."""

    def __init__(self, pid: int, stdin_fd: int, stdout_fd: int):
        self.pid = pid
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.stdout = os.fdopen(stdout_fd, "rb", buffering=0)
        self.returncode: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # gone already
            self._pidfd = None
            self.returncode = -1

    def poll(self) -> int | None:
        import select

        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            self.returncode = -1  # exited (its status is the host's to collect)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import select

        if self.returncode is None and not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("verifier", timeout)
        self.returncode = -1 if self.returncode is None else self.returncode
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def kill(self) -> None:
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Worker:
    """One verifier subprocess (independent of the caller's ``__main__``, killable at once) and
    the answers sent to it that it has not answered yet, oldest (the one in progress) first."""

    def __init__(self, timeout_s: float, code: str, announces_ready: bool, lease=None):
        lent = lease.lend(timeout_s) if lease is not None and code == WORKER_CODE else None
        if lent is not None:  # started (and math-verify imported) ahead of time by the engine host
            self.proc = _LentProcess(*lent)
        else:
            self.proc = subprocess.Popen(worker_command(timeout_s, code), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=worker_env())
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.pending: deque[tuple[int, int]] = deque()  # (key, bytes sent)
        self.pending_bytes = 0
        self.ready = not announces_ready
        self.spawned = time.monotonic()
        self.head_since = self.spawned  # when the oldest pending answer started

    def send(self, batch: list[tuple[int, bytes]]) -> None:
        """Write ``batch`` at once; raises OSError (nothing recorded) if the worker is gone."""
        self.proc.stdin.write(b"".join(m for _, m in batch))
        self.proc.stdin.flush()
        if not self.pending:
            self.head_since = time.monotonic()
        for k, m in batch:
            self.pending.append((k, len(m)))
            self.pending_bytes += len(m)

    def pop(self, now: float) -> int:
        """The answered (oldest) key; the next one starts now, when its predecessor's reply came."""
        k, size = self.pending.popleft()
        self.pending_bytes -= size
        self.head_since = now
        return k

    def read_lines(self) -> list[bytes] | None:
        """Complete lines available now; ``None`` once the worker has exited."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        *lines, self.buf = (self.buf + data).split(b"\n")
        return lines

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class VerifierPool:
    """A pool of verifier processes with a hard per-answer time limit (``timeout_s + 1`` s).

    ``worker_code`` replaces the worker program (tests use it to simulate hung checks); it must
    answer in order. ``announces_ready``: whether it writes :data:`READY` before reading (then a
    check's clock starts only once the worker is ready); default: only :data:`WORKER_CODE` does.
    ``fast_path``: settle the answers :func:`fast_verdict` decides without a worker (default: with
    the real worker only). Workers start at the first answer that needs one, or at :meth:`start`.
    """

    @classmethod
    def of(cls, reward: RewardConfig, lease=None) -> VerifierPool:
        """The pool ``reward`` (``cfg.reward``) describes: its workers, time limit and fast path;
        ``lease``: ready-made workers (the engine host's), else started here."""
        return cls(reward.workers, reward.timeout_s, fast_path=reward.fast_path, lease=lease)

    def __init__(self, workers: int = DEFAULT.workers, timeout_s: float = DEFAULT.timeout_s, worker_code: str = WORKER_CODE,
                 depth: int = PIPELINE_DEPTH, announces_ready: bool | None = None,
                 fast_path: bool | None = None, lease=None):
        self.worker_code = worker_code
        self.lease = lease
        """Where workers come from ready-made (``lease.lend(timeout_s)`` -> ``(pid, stdin_fd,
        stdout_fd)`` or None; ``lease.close()`` at exit): the engine host's stock, so a stage
        pays no math-verify import. None, or a refusal: started here."""
        self.fast_path = worker_code == WORKER_CODE if fast_path is None else fast_path
        self.fast = 0
        """Distinct answers settled by :func:`fast_verdict`."""
        self.n = max(1, workers)
        self.timeout_s = timeout_s
        self.hard_limit = timeout_s + KILL_GRACE_S
        self.depth = max(1, depth)
        self.announces_ready = worker_code == WORKER_CODE if announces_ready is None else announces_ready
        self.workers: list[_Worker] = []
        self._runs: list[deque[int]] = []  # per worker slot: answers it took but has not been sent
        self.killed = 0
        self.requeued = 0
        """Answers sent back to the queue because the worker they waited in was killed or died."""

    def _spawn(self) -> _Worker:
        return _Worker(self.timeout_s, self.worker_code, self.announces_ready, self.lease)

    def __enter__(self) -> "VerifierPool":
        return self

    def start(self, answers: int | None = None) -> None:
        """Start the workers ``answers`` answers need (one per :data:`RUN_LENGTH` of them, at most
        ``workers``; all of them if ``None``) that are not running yet, all at once: their
        imports run side by side, and alongside the caller's own work. A straggler the fast path
        left behind then costs one math-verify import, not one per worker."""
        want = self.n if answers is None else min(self.n, max(1, -(-answers // RUN_LENGTH)))
        self.workers += [self._spawn() for _ in range(want - len(self.workers))]

    def __exit__(self, *exc) -> None:
        # close every stdin first, so the workers exit together rather than one after another
        for w in self.workers:
            try:
                w.proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                w._close_pipes()
            except subprocess.TimeoutExpired:
                w.kill()
        self.workers, self._runs = [], []
        if self.lease is not None:
            self.lease.close()

    def verify(self, pairs: list[tuple[str, str]], desc: str = "verify") -> list[str]:
        """Verdicts for ``(gold, response)`` pairs, in order."""
        from tqdm.auto import tqdm

        unique = list(dict.fromkeys(pairs))
        verdicts: list[str | None] = [None] * len(unique)
        if self.fast_path:
            verdicts = [fast_verdict(g, r) for g, r in unique]
            self.fast += sum(v is not None for v in verdicts)
        todo = deque(k for k, v in enumerate(verdicts) if v is None)
        if todo:
            self.start(len(todo))
        self._runs = [deque() for _ in self.workers]
        left = len(todo)
        bar = tqdm(total=left, desc=desc, leave=False, disable=left < 2000)

        def done(k: int, v: str) -> None:
            nonlocal left
            verdicts[k] = v
            left -= 1
            bar.update()

        while left:
            self._dispatch(todo, unique)
            busy = {w.fd: w for w in self.workers if w.pending}
            ready, _, _ = select.select(list(busy), [], [], self._wait_s(busy.values()))
            for fd in ready:
                w = busy[fd]
                lines = w.read_lines()
                now = time.monotonic()
                for line in lines or []:
                    msg = json.loads(line)
                    if msg == READY:
                        w.ready = True
                        w.head_since = now  # the oldest answer starts only now
                        continue
                    k, v = msg
                    if not w.pending or k != w.pending[0][0]:
                        raise RuntimeError(f"verifier worker answered {k} out of turn")
                    done(w.pop(now), v)
                if lines is None:  # it exited: the answer in progress counts as a timeout
                    self._lost(w, done, "exited")
            now = time.monotonic()
            for w in self.workers:
                if not w.pending:
                    continue
                if not w.ready:
                    if now - w.spawned > STARTUP_LIMIT_S and not select.select([w.fd], [], [], 0)[0]:
                        raise RuntimeError(f"verifier worker not ready after {STARTUP_LIMIT_S:.0f}s")
                elif now - w.head_since > self.hard_limit and not select.select([w.fd], [], [], 0)[0]:
                    log.warning("verification exceeded %.1fs; killing its worker", self.hard_limit)
                    self._lost(w, done, "killed")
        bar.close()
        index = {p: k for k, p in enumerate(unique)}
        return [verdicts[index[p]] for p in pairs]

    def _dispatch(self, todo: deque[int], unique: list[tuple[str, str]]) -> None:
        """Top up every worker's pipeline from its run, a block of consecutive answers it took
        from ``todo``: rollouts come prompt by prompt, so a worker sees a prompt's samples (and
        their shared gold, parsed once) together, and sympy's caches keep what they share. A
        worker with nothing left takes half of another's unsent run, so the tail stays balanced."""
        for slot, w in enumerate(self.workers):
            run = self._runs[slot]
            batch: list[tuple[int, bytes]] = []
            size = w.pending_bytes
            while len(w.pending) + len(batch) < self.depth:
                if not run and not self._refill(run, todo):
                    break
                msg = json.dumps([run[0], *unique[run[0]]]).encode() + b"\n"
                if (w.pending or batch) and size + len(msg) > PIPELINE_BYTES:
                    break
                batch.append((run.popleft(), msg))
                size += len(msg)
            if not batch:
                continue
            try:
                w.send(batch)
            except OSError:  # it exited: these go back; its pending ones are settled when its EOF is read
                run.extendleft(k for k, _ in reversed(batch))
                if not w.pending:  # it died idle: nothing to settle, unless it never got ready
                    while not w.ready and select.select([w.fd], [], [], 0.1)[0]:
                        lines = w.read_lines()
                        if lines is None:
                            break
                        w.ready = json.dumps(READY).encode() in lines
                    if not w.ready:
                        raise RuntimeError(f"verifier worker exited before it was ready (exit code {w.proc.poll()})")
                    self._replace(slot)

    def _refill(self, run: deque[int], todo: deque[int]) -> bool:
        """Give an empty ``run`` the next block of ``todo``, or else half of the longest other run."""
        if todo:
            run.extend(todo.popleft() for _ in range(min(RUN_LENGTH, len(todo))))
            return True
        victim = max(self._runs, key=len)
        if not victim:
            return False
        run.extendleft(victim.pop() for _ in range((len(victim) + 1) // 2))
        return True

    def _wait_s(self, busy) -> float:
        """Until the nearest kill deadline (at most 0.25 s, and not busy-looping)."""
        now = time.monotonic()
        waits = [w.head_since + self.hard_limit - now for w in busy if w.ready]
        return max(0.0, min([0.25, *waits])) if waits else 0.25 if busy else 0.0

    def _lost(self, w: _Worker, done, why: str) -> None:
        """``w`` is gone (``why``): its answer in progress is a timeout, the rest go back to its run."""
        slot = self.workers.index(w)
        if not w.ready:  # it never checked anything: nothing of ours killed it
            raise RuntimeError(f"verifier worker {why} before it was ready (exit code {w.proc.poll()})")
        keys = [k for k, _ in w.pending]
        if keys:
            done(keys[0], TIMEOUT)
            self._runs[slot].extendleft(reversed(keys[1:]))
            self.requeued += len(keys) - 1
        self._replace(slot)

    def _replace(self, slot: int) -> None:
        self.workers[slot].kill()
        self.killed += 1
        self.workers[slot] = self._spawn()


def reward_of(verdict: str) -> float | None:
    """Binary reward; ``None`` means the sample is skipped (the gold answer does not parse)."""
    if verdict == GOLD_UNPARSEABLE:
        return None
    return 1.0 if verdict == CORRECT else 0.0
