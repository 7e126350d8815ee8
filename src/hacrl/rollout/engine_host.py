"""The engine host: one process per workspace that keeps rollout engine processes (vLLM workers)
alive across stages and iterations.

Under ``dvc repro`` and Prefect every stage is its own process, and a vLLM worker costs 17-21 s
to start on this CPU (more on a GPU with a large model), paid by every generate-rollouts stage of
every iteration. So a stage does not start the worker itself: it asks the workspace's engine host
for "agent A at checkpoint H" (H: the content hash DVC records for the checkpoint directory the
stage reads). The host keeps one worker per agent and, before it serves the stage, makes the
worker serve H: a reuse when it already does, vLLM's in-place reload when it serves other
weights, a start when it has none (or its settings changed). Every request the stage sends then
goes through the host to that worker, under the agent's lock: a stage holds its agent's engine
for the whole session, and no other weights can be swapped in under it.

What keeps it safe:

- **weights by content, not by path**: the host compares the hash the stage names with the hash
  it last loaded; a checkpoint edited and re-committed under the same path is reloaded;
- **one host per workspace** (its socket is named after the project's real path, the user and
  the interpreter): two workspaces never share an engine;
- **code changes**: a host whose code (hacrl's sources, installed packages) changed since it
  started refuses new sessions and exits once idle; the client then starts a fresh one;
- **failures**: the host killed (``kill -9``) mid-stage: the stage's next request fails, and the
  client starts a new host and retries the session once (a generate call is deterministic: same
  prompts, same per-prompt seeds, same weights); a worker that dies mid-request is dropped by
  the host and restarted on the retry; the workers are in the host's care: when it dies, their
  stdin closes and they exit;
- **idle**: an engine no stage used for ``engines.host_idle_s`` is stopped; the host exits when
  it serves none; ``hacrl stop`` / ``make stop`` stop it at once.

Protocol: a Unix stream socket, one JSON object per line. A session opens with
``{"open": {"engine", "entry", "agent", "model_dir", "weights", "settings"}}`` (``engine``: the
engine table's row, ``entry`` its class, whose ``worker`` the host starts; reply: ``{"ok", "mode", "seconds",
"startup_s"}``), then sends ``{"call": REQUEST}`` (the worker's own requests, e.g.
:mod:`hacrl.rollout.vllm_worker`'s), ``{"sleep": true}`` (an MWRA release: vLLM sleep mode where the
worker has it, else a stop), ``{"release": true}`` (stop the worker), and ends by closing the
connection. ``{"lend": {"timeout_s"}}`` hands over a verifier worker (:class:`VerifierLease`). A
connection may instead send ``{"status": true}`` (the engines) or ``{"stop": true}``.

This module is the client (what a stage and ``hacrl stop`` use);
:mod:`hacrl.rollout.engine_host_server` is the host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hacrl import sockets
from hacrl.rollout.engine import EngineError

log = logging.getLogger(__name__)

START_WAIT_S = 60.0
"""How long a client waits for a host it started (its imports take a second or two)."""


class HostError(RuntimeError):
    """The engine host refused or failed a request; the message says why."""


def enabled() -> bool:
    """Off with ``HACRL_ENGINE_HOST=0`` (``engines.host`` turns it off per experiment)."""
    return os.environ.get("HACRL_ENGINE_HOST", "1") != "0"


def socket_path(project: str | os.PathLike) -> Path:
    """The engine host's socket of the workspace at ``project``: per user, interpreter and real
    path (short, as a Unix socket path must be)."""
    key = json.dumps([os.path.realpath(project), sys.executable])
    return Path(tempfile.gettempdir()) / f"hacrl-engines-{os.getuid()}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.sock"


# ---------------------------------------------------------------------------------- client
class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.f = sock.makefile("rwb")

    def ask(self, msg: dict) -> dict:
        try:
            self.f.write(json.dumps(msg).encode() + b"\n")
            self.f.flush()
            line = self.f.readline()
        except OSError:
            line = b""
        if not line:
            raise ConnectionError("the engine host closed the connection (killed, or it stopped)")
        return json.loads(line)

    def close(self) -> None:
        for c in (self.f, self.sock):
            try:
                c.close()
            except OSError:
                pass

    def detach(self) -> socket.socket:
        """The raw socket, for a caller that reads it itself (the hello's reply was read whole)."""
        self.f.close()
        return self.sock


def _connect(path: Path, wait_s: float = 0.0, server: subprocess.Popen | None = None) -> socket.socket | None:
    return sockets.connect(path, socket.SOCK_STREAM, wait_s, server)


def _start_host(path: Path, project: Path, idle_s: float) -> subprocess.Popen:
    with open(path.with_suffix(".log"), "ab") as out:
        # its own session: a stage killed with its process group (kill -9 of dvc repro) leaves
        # the host and its engines for the rerun
        return subprocess.Popen([sys.executable, "-m", "hacrl.rollout.engine_host_server", str(path), str(project),
                                 str(idle_s)], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, close_fds=True, cwd=str(project))


def connect(project: str | os.PathLike, idle_s: float = 900.0) -> _Conn:
    """A connection to the workspace's engine host, started (and waited for) if none answers."""
    project = Path(project).resolve()
    path = socket_path(project)
    for attempt in range(2):
        s = _connect(path)
        if s is None:
            proc = _start_host(path, project, idle_s)
            s = _connect(path, wait_s=START_WAIT_S, server=proc)
            if s is None:
                tail = ""
                try:
                    tail = "\n".join(path.with_suffix(".log").read_text(errors="replace").splitlines()[-10:])
                except OSError:
                    pass
                raise HostError(f"the engine host did not start (log: {path.with_suffix('.log')}):\n{tail}")
        conn = _Conn(s)
        try:
            hello = conn.ask({"hello": True})
        except ConnectionError:
            conn.close()
            continue
        if hello.get("ok"):
            return conn
        conn.close()
        if hello.get("refused") == "stale" and not attempt:  # the code changed: a fresh host
            sockets.wait_gone(path, 10.0)
            continue
        raise HostError(f"the engine host refused: {hello.get('refused') or hello.get('error')}")
    raise HostError("no engine host answered")


def stop(project: str | os.PathLike) -> bool:
    """Stop the workspace's engine host and its engines; whether one was running."""
    s = _connect(socket_path(project))
    if s is None:
        return False
    conn = _Conn(s)
    try:
        conn.ask({"stop": True})
    except ConnectionError:
        pass
    finally:
        conn.close()
    return True


def status(project: str | os.PathLike) -> dict | None:
    """The workspace's host: ``{"pid", "engines": [{"agent", "weights", "pid", ...}]}`` (None: no host)."""
    s = _connect(socket_path(project))
    if s is None:
        return None
    conn = _Conn(s)
    try:
        return conn.ask({"status": True})
    except ConnectionError:
        return None
    finally:
        conn.close()


class VerifierLease:
    """Verifier processes (:mod:`hacrl.task.rewards`) from the engine host's stock, started and
    past their math-verify import before the stage asked: ``VerifierPool(lease=...)``.

    One connection per pool; each ``lend`` hands over one worker (its pid and pipe ends, over the
    socket) that the stage then owns (it stops it as it would its own). When the pool closes the
    lease, the host starts as many again, to be ready for the next stage: their imports run
    between stages rather than inside one. Any failure: None, and the pool starts its own.
    """

    def __init__(self, project: str | os.PathLike, idle_s: float = 900.0):
        self.project, self.idle_s = Path(project), idle_s
        self.sock: socket.socket | None = None
        self.failed = False
        self.lent = 0

    def lend(self, timeout_s: float) -> tuple[int, int, int] | None:
        if self.failed:
            return None
        try:
            if self.sock is None:
                self.sock = connect(self.project, self.idle_s).detach()
            self.sock.sendall(json.dumps({"lend": {"timeout_s": float(timeout_s)}}).encode() + b"\n")
            msg, fds, _, _ = socket.recv_fds(self.sock, 4096, 2)
            while msg and not msg.endswith(b"\n"):
                more = self.sock.recv(4096)
                if not more:
                    break
                msg += more
            reply = json.loads(msg or b"{}")
            if not reply.get("ok") or len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                raise HostError(reply.get("error") or "no worker")
        except (OSError, ValueError, HostError, ConnectionError) as e:
            log.info("verifier workers start here (engine host: %s)", e)
            self.failed = True
            self.close()
            return None
        self.lent += 1
        return int(reply["pid"]), fds[0], fds[1]

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


class HostedProcess:
    """A stage's session with the engine host: the calls of a worker process
    (:class:`hacrl.rollout.worker_engine.WorkerProcess`: ``call``, ``reload``, ``sleep``, ``wake``,
    ``stop``, ``close``), served by the host's worker for ``agent`` at ``weights``: the worker of
    the engine class ``entry`` names (the engine table row's ``module:Class``).

    A lost host, or a worker that died, is retried once: a new session (a new host if need be)
    on the same checkpoint, then the same request.
    """

    def __init__(self, project: str | os.PathLike, agent: str, model_dir: str | Path, weights: str, settings: dict,
                 idle_s: float = 900.0, engine: str = "vllm", entry: str = "hacrl.rollout.vllm_engine:VLLMEngine"):
        if not weights:
            raise HostError(f"engine host: no content hash for {model_dir} (the host serves weights by hash)")
        self.project, self.agent, self.settings, self.idle_s = Path(project), agent, settings, idle_s
        self.engine, self.entry = engine, entry
        self.model_dir, self.weights = str(model_dir), weights
        self.asleep = False
        self.conn: _Conn | None = None
        self.opened = self._open()

    @property
    def alive(self) -> bool:
        return self.conn is not None

    def _open(self) -> dict:
        self.conn = connect(self.project, self.idle_s)
        reply = self.conn.ask({"open": {"engine": self.engine, "entry": self.entry, "agent": self.agent,
                                        "model_dir": str(Path(self.model_dir).resolve()),
                                        "weights": self.weights, "settings": self.settings}})
        if not reply.get("ok"):
            self.close()
            raise _engine_error(reply)
        self.asleep = False
        log.info("engine host: %s at %s: %s in %.2fs", self.agent, self.weights[:12], reply["mode"], reply["seconds"])
        return {k: reply[k] for k in ("mode", "seconds", "startup_s") if k in reply}

    def _ask(self, msg: dict) -> dict:
        for attempt in range(2):
            try:
                if self.conn is None:
                    self._open()
                reply = self.conn.ask(msg)
            except ConnectionError as e:
                self.close()
                if attempt:
                    raise HostError(f"engine host for {self.agent}: {e}") from None
                log.warning("engine host for %s: %s; a new session", self.agent, e)
                continue
            if reply.get("ok") or not reply.get("retry") or attempt:
                return reply
            log.warning("engine host for %s: %s; a new session", self.agent, reply.get("error"))
            self.close()
        return reply

    def call(self, req: dict) -> dict:
        reply = self._ask({"call": req})
        if not reply.get("ok"):
            raise _engine_error(reply)
        return reply["reply"]

    def reload(self, weights_dir: str | Path, weights: str | None = None) -> dict:
        """Serve another checkpoint (a new session on it), named by its content hash (``weights``,
        else hashed here: the host must never take the old hash for new weights)."""
        from hacrl.hashes import cached_dvc_hash

        t0 = time.time()
        self.close()
        self.model_dir = str(weights_dir)
        self.weights = weights or cached_dvc_hash(self.project, weights_dir)
        sync = self._open()
        return {"mode": sync["mode"], "seconds": time.time() - t0}

    def sleep(self) -> None:
        if self.conn is not None:
            self._ask({"sleep": True})
            self.asleep = True

    def wake(self) -> None:
        if self.conn is None:
            self._open()
        self.asleep = False  # the host wakes a sleeping worker at the next request

    def stop(self) -> None:
        """Stop the host's worker for this agent (frees its device), then end the session."""
        if self.conn is not None:
            try:
                self.conn.ask({"release": True})
            except ConnectionError:
                pass
        self.close()

    def close(self, force: bool = False) -> None:
        """End the session; the host keeps the worker."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _engine_error(reply: dict) -> Exception:
    return EngineError(reply.get("error") or "engine host: request failed")


