"""The engine host's server (:mod:`hacrl.rollout.engine_host` describes it): one thread per
connection, one worker per agent, run as ``python -m hacrl.rollout.engine_host_server SOCKET
PROJECT IDLE_S`` by the first stage that needs it."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hacrl import sockets
from hacrl.rollout.engine import EngineError
from hacrl.rollout.engine_host import _Conn, _connect
from hacrl.rollout.table import load_entry
from hacrl.runtime import apply_defaults

log = logging.getLogger(__name__)


class _Engine:
    def __init__(self, agent: str):
        self.agent = agent
        self.lock = threading.Lock()
        self.proc = None  # a worker process of the engine's row (rollout.worker_engine.WorkerProcess)
        self.weights = ""
        self.settings: dict = {}
        self.engine = ""
        self.last_used = time.monotonic()
        self.sessions = 0

    def describe(self) -> dict:
        return {"agent": self.agent, "engine": self.engine, "weights": self.weights,
                "pid": self.proc.pid if self.proc else None,
                "model_dir": self.proc.model_dir if self.proc else None, "sessions": self.sessions,
                "asleep": bool(self.proc and self.proc.asleep), "idle_s": round(time.monotonic() - self.last_used, 1)}

    def serve(self, engine: str, entry: str, model_dir: str, weights: str, settings: dict) -> dict:
        """Make a worker of ``engine`` (its class: ``entry``, ``module:Class`` of the engine table's
        row) serve ``weights`` (from ``model_dir``) under ``settings``."""
        t0 = time.time()
        if self.proc is not None and (self.settings != settings or self.engine != engine or not self.proc.alive):
            self.close()
        if self.proc is None:
            try:
                worker = load_entry(entry).worker
            except (ImportError, AttributeError, ValueError) as e:
                raise EngineError(f"engine host: {entry!r} names no engine with a worker process ({e})") from None
            self.weights = ""  # nothing is served until the start succeeds
            self.proc = worker(model_dir, settings)
            self.settings, self.weights, self.engine = settings, weights, engine
            return {"mode": "start", "seconds": time.time() - t0, "startup_s": self.proc.opened.get("startup_s")}
        if self.weights == weights:
            if self.proc.asleep:
                self.proc.wake()
            return {"mode": "reuse", "seconds": time.time() - t0}
        self.weights = ""  # a failed reload leaves no weights anyone could be served
        self.proc.reload(model_dir)
        self.weights = weights
        return {"mode": "in_place", "seconds": time.time() - t0}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
        self.proc, self.weights, self.settings, self.engine = None, "", {}, ""


class Host:
    """The server: one thread per connection, one :class:`_Engine` per agent."""

    def __init__(self, path: Path, project: Path, idle_s: float):
        from hacrl.hashes import code_fingerprint

        self.path, self.project, self.idle_s = path, project, idle_s
        self.engines: dict[str, _Engine] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.connections = 0
        self.print = code_fingerprint()
        self.last_activity = time.monotonic()
        self.verifiers = _VerifierStock()

    def _engine(self, agent: str) -> _Engine:
        with self.lock:
            return self.engines.setdefault(agent, _Engine(agent))

    def stale(self) -> bool:
        from hacrl.hashes import code_fingerprint

        return code_fingerprint() != self.print

    def handle(self, sock: socket.socket) -> None:
        conn = _Conn(sock)
        held: _Engine | None = None
        lent: list[float] = []  # timeouts of the verifier workers this connection took
        with self.lock:
            self.connections += 1
        try:
            while True:
                try:
                    line = conn.f.readline()
                except OSError:
                    line = b""
                if not line:
                    return
                msg = json.loads(line)
                if "lend" in msg:
                    self._lend(sock, msg["lend"], lent)
                    continue
                reply = self._reply(msg, held)
                if isinstance(reply, tuple):  # an open: the session now holds the agent's engine
                    held, reply = reply
                try:
                    conn.f.write(json.dumps(reply).encode() + b"\n")
                    conn.f.flush()
                except OSError:
                    return
                if msg.get("stop"):
                    self.stopping.set()
                    return
        finally:
            if held is not None:
                held.sessions -= 1
                held.last_used = time.monotonic()
                held.lock.release()
            with self.lock:
                self.connections -= 1
                self.last_activity = time.monotonic()
            conn.close()
            if lent:  # ready for the next stage: started now, between stages
                self.verifiers.restock(lent)

    def _reply(self, msg: dict, held: _Engine | None):
        if "hello" in msg:
            if self.stopping.is_set():
                return {"ok": False, "refused": "stopping"}
            if self.stale():
                self.stopping.set()  # exits once its sessions end
                log.info("the code changed since this host started: no new sessions")
                return {"ok": False, "refused": "stale"}
            return {"ok": True, "pid": os.getpid()}
        if "status" in msg:
            with self.lock:
                engines = [e.describe() for e in self.engines.values() if e.proc is not None]
            return {"ok": True, "pid": os.getpid(), "engines": engines, **self.verifiers.counts()}
        if "stop" in msg:
            return {"ok": True}
        if "open" in msg:
            if held is not None:
                return {"ok": False, "error": "engine host: this session already holds an engine"}
            o = msg["open"]
            eng = self._engine(o["agent"])
            eng.lock.acquire()  # one stage at a time per agent's engine
            eng.sessions += 1
            try:
                out = eng.serve(o["engine"], o["entry"], o["model_dir"], o["weights"], o["settings"])
            except (EngineError, OSError) as e:
                eng.close()
                eng.sessions -= 1
                eng.lock.release()
                return {"ok": False, "error": str(e)}
            log.info("%s at %s (%s): %s in %.2fs", o["agent"], o["weights"][:12], o["model_dir"], out["mode"],
                     out["seconds"])
            return eng, {"ok": True, **out}
        if held is None or held.proc is None:
            return {"ok": False, "retry": True, "error": "engine host: no engine open in this session"}
        if "sleep" in msg:  # vLLM sleep mode where the worker was started with it, else a stop
            try:
                held.proc.sleep()
                if not held.proc.alive:
                    held.close()
                return {"ok": True}
            except EngineError as e:
                held.close()
                return {"ok": False, "error": str(e)}
        if "release" in msg:
            held.close()
            return {"ok": True}
        if "call" in msg:
            try:
                if held.proc.asleep:
                    held.proc.wake()
                return {"ok": True, "reply": held.proc.call(msg["call"])}
            except EngineError as e:
                dead = not held.proc.alive
                if dead:  # its worker died: drop it; a retry starts a fresh one on the same weights
                    held.close()
                return {"ok": False, "retry": dead, "error": str(e)}
        return {"ok": False, "error": f"engine host: unknown request {sorted(msg)}"}

    def _lend(self, sock: socket.socket, req: dict, lent: list[float]) -> None:
        """Hand one ready verifier worker to the connection (its pid, then its pipes' ends)."""
        if self.stopping.is_set():
            sock.sendall(json.dumps({"ok": False, "error": "stopping"}).encode() + b"\n")
            return
        timeout_s = float(req["timeout_s"])
        proc = self.verifiers.take(timeout_s)
        try:
            socket.send_fds(sock, [json.dumps({"ok": True, "pid": proc.pid}).encode() + b"\n"],
                            [proc.stdin.fileno(), proc.stdout.fileno()])
            lent.append(timeout_s)
        finally:  # the borrower owns it now: the host keeps only its pid, to reap it
            self.verifiers.handed(proc)

    def reap(self) -> bool:
        """Stop engines idle past ``idle_s``; whether the host should exit."""
        self.verifiers.reap()
        now = time.monotonic()
        with self.lock:
            engines = list(self.engines.values())
            busy = self.connections
        for e in engines:
            if e.proc is not None and now - e.last_used > self.idle_s and e.lock.acquire(blocking=False):
                try:
                    log.info("%s: idle for %.0fs, stopped", e.agent, now - e.last_used)
                    e.close()
                finally:
                    e.lock.release()
        served = any(e.proc is not None for e in engines)
        return not busy and not served and now - self.last_activity > min(self.idle_s, 60.0)

    def shutdown(self) -> None:
        for e in list(self.engines.values()):
            e.close()
        self.verifiers.close()


class _VerifierStock:
    """Verifier processes started ahead of time, per answer time limit; lent ones reaped."""

    MAX = 16

    def __init__(self):
        self.lock = threading.Lock()
        self.ready: dict[float, list[subprocess.Popen]] = {}
        self.lent: list[subprocess.Popen] = []

    @staticmethod
    def _start(timeout_s: float) -> subprocess.Popen:
        from hacrl.task.rewards import worker_command, worker_env

        return subprocess.Popen(worker_command(timeout_s), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=worker_env())

    def take(self, timeout_s: float) -> subprocess.Popen:
        with self.lock:
            stock = self.ready.get(timeout_s, [])
            while stock:
                p = stock.pop(0)
                if p.poll() is None:
                    return p
                self._close(p)
        return self._start(timeout_s)  # none ready: started now (the borrower waits for its import)

    def handed(self, proc: subprocess.Popen) -> None:
        for f in (proc.stdin, proc.stdout):
            f.close()
        with self.lock:
            self.lent.append(proc)

    def restock(self, timeouts: list[float]) -> None:
        with self.lock:
            for t in timeouts:
                if sum(map(len, self.ready.values())) < self.MAX:
                    self.ready.setdefault(t, []).append(self._start(t))

    def reap(self) -> None:
        with self.lock:
            self.lent = [p for p in self.lent if p.poll() is None]

    def counts(self) -> dict:
        """Stocked workers, and how many have finished their import (their ready line waits
        unread in their pipe, for the borrower)."""
        import select

        with self.lock:
            stock = [p for v in self.ready.values() for p in v if p.poll() is None]
            ready = sum(bool(select.select([p.stdout], [], [], 0)[0]) for p in stock)
        return {"verifiers_stocked": len(stock), "verifiers_ready": ready}

    @staticmethod
    def _close(p: subprocess.Popen) -> None:
        for f in (p.stdin, p.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            p.kill()
            p.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def close(self) -> None:
        with self.lock:
            for p in [q for v in self.ready.values() for q in v] + self.lent:
                if p.poll() is None and p in self.lent:
                    continue  # a borrower's: it stops it
                self._close(p)
            self.ready = {}


def serve(path: Path, project: Path, idle_s: float) -> None:
    """Serve the workspace at ``project`` on ``path`` until stopped, stale and idle, or idle."""
    host = Host(path, project, idle_s)
    probe = _connect(path)
    if probe is not None:  # two clients started a host at once: the one that is up serves
        probe.close()
        log.info("a host already answers at %s: exiting", path)
        return
    tmp = path.with_name(path.name + f".{os.getpid()}")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp))
    os.chmod(tmp, 0o600)
    srv.listen(16)
    os.replace(tmp, path)  # a client never connects to a half-set-up host
    bound_ino = os.stat(path).st_ino
    srv.settimeout(1.0)
    log.info("engine host %d ready at %s for %s", os.getpid(), path, project)
    try:
        while not host.stopping.is_set() or host.connections:
            try:
                sock, _ = srv.accept()
            except TimeoutError:
                if host.reap():
                    log.info("idle, no engines: exiting")
                    return
                continue
            sock.settimeout(None)
            threading.Thread(target=host.handle, args=(sock,), daemon=True).start()
    finally:
        sockets.unlink_own(path, bound_ino)
        srv.close()
        host.shutdown()
        log.info("stopped")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-host: %(message)s",
                        datefmt="%H:%M:%S")
    apply_defaults()
    serve(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 900.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
