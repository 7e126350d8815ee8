"""A warm process that starts stage processes with their imports already done.

Under ``dvc repro`` and Prefect every stage is its own process (``hacrl stage NAME``), and most
of a short stage's time went to imports: torch, transformers and its model classes, DeepSpeed,
pandas (2-5 s per stage against milliseconds for the stage's work when they are already
loaded). So ``hacrl stage`` is a thin client: it hands its arguments, working directory,
environment and its stdin/stdout/stderr file descriptors to a server over a Unix socket; the
server, which imported all of that once, ``fork``\\ s a child that becomes the stage process
(it writes straight to the client's pipes, in its own process group) and the client waits for
its exit code. The first stage of a run starts the server and waits for it (rather than run
cold while the server imports: on a loaded 2-core machine BLAS picked other kernels, and a
warm-up's figures changed).

What keeps a forked stage the same as a cold one:

- the server never runs tensor code, starts no thread and touches no GPU before forking (CUDA,
  OpenMP and thread pools start in the child, as in a fresh process), and the child takes the
  client's environment, directory, umask and arguments;
- the server refuses a request (the client then runs cold) once any source file of ``hacrl``
  or the installed packages changed since it started, and exits; one server per project,
  interpreter and import-relevant environment (``HF_*``, ``TORCH*``, ``CUDA*``, ``OMP_*`` ...);
- the child watches the client's pid: when the client dies (``kill -9`` of ``dvc repro``'s
  process group), the child kills its own group at once; SIGINT/SIGTERM sent to the client are
  forwarded to it;
- it exits after ``IDLE_S`` without a request (``hacrl stop`` stops it at once).

``HACRL_STAGE_SERVER=0`` turns it off (every stage cold). The tests run the pipeline both ways
and compare the artifacts byte for byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from hacrl import sockets
from hacrl.runtime import apply_defaults

log = logging.getLogger(__name__)

IDLE_S = 600.0
START_WAIT_S = 60.0
"""How long the first stage waits for the server it started (its imports take a few seconds)."""
ENV_KEYS = ("HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA", "OMP_", "MKL_", "KMP_", "DS_", "TOKENIZERS_",
            "NCCL_", "PYTHON", "LD_", "VIRTUAL_ENV")
"""Environment variables a preloaded module may have read at import: a server serves only
clients whose values match the ones it started with."""
PRELOAD = ("torch", "pandas", "pyarrow.parquet", "transformers", "hacrl.rollout.hf", "hacrl.ops.track_queue")
"""Imported before the server forks, besides every stage's module (from the stage table)."""
MODEL_CLASSES = ("gpt2", "llama", "qwen2", "mistral", "qwen3")
"""transformers model modules imported up front (each costs 0.2-0.6 s when a stage first loads one)."""
MAX_MSG = 1 << 20


def enabled() -> bool:
    return os.environ.get("HACRL_STAGE_SERVER", "1") != "0"


def _key() -> str:
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_KEYS))
    blob = json.dumps([sys.executable, env])
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def socket_path() -> Path:
    """Per user, interpreter and import-relevant environment (any project: a child takes its
    client's directory); short, as a Unix socket path must be."""
    return Path(tempfile.gettempdir()) / f"hacrl-{os.getuid()}-{_key()}.sock"


def fingerprint() -> str:
    """Changes when any hacrl source file or the set of installed packages changes."""
    from hacrl.hashes import code_fingerprint

    return code_fingerprint()


# ---------------------------------------------------------------------------------- client
def run_remote(argv: list[str], entry: str) -> int | None:
    """Run ``entry(ARGV)`` in a forked child of the server (started, and waited for, if there is
    none); None: no server served it, run cold. ``entry``: the command's main function as
    ``module:function`` (``hacrl.cli:main``), handed to the server, which imports it before it
    forks: the server knows nothing of the command it serves."""
    path = socket_path()
    for attempt in range(2):
        s = _connect(path)
        if s is None:
            # start one and wait for it, rather than run cold beside its imports: on a loaded CPU,
            # BLAS may pick other kernels, and a stage's figures must not depend on that
            proc = _start_server(path, entry)
            s = _connect(path, wait_s=START_WAIT_S, server=proc) if proc is not None else None
            if s is None:
                return None
        req = {"argv": argv, "entry": entry, "cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid(),
               "umask": _umask(), "limits": _limits()}
        try:
            socket.send_fds(s, [json.dumps(req).encode()], [0, 1, 2])
            reply = json.loads(s.recv(MAX_MSG) or b'{"refused": "closed"}')
        except (OSError, ValueError):
            s.close()
            return None
        if "refused" not in reply:
            break
        s.close()
        log.debug("stage server refused: %s", reply["refused"])
        if reply["refused"] != "stale" or attempt:
            return None
        _wait_gone(path)  # the stale server removes its socket as it exits; then start afresh
    with s:
        child = int(reply["pid"])

        def forward(signum, _frame):
            try:
                os.killpg(child, signum)
            except ProcessLookupError:
                pass

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, forward)
        try:
            msg = s.recv(MAX_MSG)
        except OSError:
            msg = b""
        if not msg:  # the child died without a word (a signal, an out-of-memory kill)
            print("hacrl: error: the stage process died (killed by a signal?)", file=sys.stderr)
            return 1
        return int(json.loads(msg)["exit"])


ABOUT = ".json"
"""Beside a server's socket: its pid and interpreter (``sys.prefix``), so that ``hacrl stop`` finds
every server of a checkout, whatever environment variables each was started with."""


def stop(path: Path | None = None) -> bool:
    """Ask this environment's server (or the one at ``path``) to exit; whether one was running."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(str(path or socket_path()))
        s.send(json.dumps({"stop": True}).encode())
        return True
    except OSError:
        return False
    finally:
        s.close()


def stop_checkout(project: str | os.PathLike) -> int:
    """Stop this environment's server and every server of this user whose interpreter lives in
    ``project`` (its virtual environments: ``.venv``, ``.venv-vllm``...), whatever environment
    variables each was started with; how many were running."""
    root = Path(project).resolve()
    own = socket_path()
    n = 0
    for about in Path(tempfile.gettempdir()).glob(f"hacrl-{os.getuid()}-*.sock{ABOUT}"):
        try:
            info = json.loads(about.read_text())
        except (OSError, ValueError):
            continue
        sock = about.with_name(about.name.removesuffix(ABOUT))
        if sock != own and Path(info.get("prefix", "/")).resolve().is_relative_to(root):
            n += stop(sock)
    return n + stop(own)  # this environment's, wherever its interpreter lives


def _connect(path: Path, wait_s: float = 0.0, server: subprocess.Popen | None = None) -> socket.socket | None:
    return sockets.connect(path, socket.SOCK_SEQPACKET, wait_s, server)


def _wait_gone(path: Path, wait_s: float = 5.0) -> None:
    sockets.wait_gone(path, wait_s)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _start_server(path: Path, entry: str) -> subprocess.Popen | None:
    """Start a server for ``entry`` in the background (its output goes to a log beside the socket)."""
    try:
        with open(path.with_suffix(".log"), "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "hacrl.ops.stage_server", str(path), entry],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                    close_fds=True)
    except OSError as e:
        log.debug("no stage server: %s", e)
        return None


# ---------------------------------------------------------------------------------- server
def _entry(entry: str):
    """The function ``module:function`` names (its module imported now)."""
    import importlib

    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


def _preload() -> None:
    import importlib

    from hacrl.pipeline import table

    for m in (*PRELOAD, *(s.entry.partition(":")[0] for s in table.STAGES)):
        importlib.import_module(m)
    if not Path("/dev/nvidia0").exists():  # DeepSpeed probes the accelerator at import: not on GPU hosts
        importlib.import_module("deepspeed")
    for arch in MODEL_CLASSES:
        try:
            importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        except ImportError:
            pass
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def serve(path: Path, entry: str, idle_s: float = IDLE_S) -> None:
    """Preload (``entry`` too), then fork one process per request that runs ``entry(argv)``,
    until idle or stale."""
    _preload()
    main_fn = _entry(entry)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:  # two clients started a server at once: the one that is up already serves
        probe.connect(str(path))
        probe.close()
        log.info("a server already answers at %s: exiting", path)
        return
    except OSError:
        probe.close()
    start_print = fingerprint()
    tmp = path.with_name(path.name + f".{os.getpid()}")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(str(tmp))
    srv.listen(16)
    os.replace(tmp, path)  # a client never connects to a half-set-up server
    bound_ino = os.stat(path).st_ino
    about = path.with_name(path.name + ABOUT)  # whose server this is, for `hacrl stop` of a checkout
    about.write_text(json.dumps({"pid": os.getpid(), "prefix": sys.prefix, "executable": sys.executable}))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    log.info("stage server %d ready at %s", os.getpid(), path)
    try:
        while True:
            ready, _, _ = select.select([srv], [], [], idle_s)
            if not ready:
                log.info("idle for %.0fs: exiting", idle_s)
                return
            conn, _ = srv.accept()
            try:
                msg, fds, _, _ = socket.recv_fds(conn, MAX_MSG, 3)
                req = json.loads(msg)
                if req.get("stop"):
                    log.info("asked to stop")
                    return
            except (OSError, ValueError) as e:
                log.warning("bad request: %s", e)
                conn.close()
                continue
            if req.get("entry") != entry:  # another command's client: it runs cold
                conn.send(json.dumps({"refused": "entry"}).encode())
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            if fingerprint() != start_print:
                conn.send(json.dumps({"refused": "stale"}).encode())
                conn.close()
                for fd in fds:
                    os.close(fd)
                log.info("the code changed since this server started: exiting")
                return
            pid = os.fork()
            if pid == 0:
                srv.close()
                _child(conn, req, fds, main_fn)  # never returns
            log.info("stage process %d: hacrl %s (in %s)", pid, " ".join(req["argv"]), req["cwd"])
            for fd in fds:
                os.close(fd)
            conn.close()
    finally:
        sockets.unlink_own(path, bound_ino)
        srv.close()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(about.read_text()).get("pid") == os.getpid():
                about.unlink()


LIMITS = ("RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_CORE")
"""The caller's resource limits a forked stage runs under, as a cold process would (``ulimit -f``:
the file-size limit a user set to protect a disk)."""


def _limits() -> dict[str, list[int]]:
    import resource

    return {n: list(resource.getrlimit(getattr(resource, n))) for n in LIMITS if hasattr(resource, n)}


def _set_limits(limits: dict[str, list[int]]) -> None:
    """Apply the caller's limits; a limit above what this server may grant is capped at its own
    hard limit (a process can lower its limits, never raise its hard ones)."""
    import math
    import resource

    def num(v: int) -> float:
        return math.inf if v == resource.RLIM_INFINITY else v

    def lim(v: float) -> int:
        return resource.RLIM_INFINITY if v == math.inf else int(v)

    for name, (soft, hard) in limits.items():
        if not hasattr(resource, name):
            continue
        which = getattr(resource, name)
        hard_v = min(num(hard), num(resource.getrlimit(which)[1]))
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(which, (lim(min(num(soft), hard_v)), lim(hard_v)))


def _child(conn: socket.socket, req: dict, fds: list[int], main_fn) -> None:
    """Become the process of the request (``main_fn(argv)``); exit with its code."""
    rc = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgid(0, 0)  # its own group: killed as one (with its verifier and update workers)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.chdir(req["cwd"])
        os.umask(req["umask"])
        _set_limits(req.get("limits") or {})
        os.environ.clear()
        os.environ.update(req["env"])
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        _watch(int(req["pid"]))
        conn.send(json.dumps({"pid": os.getpid()}).encode())
        sys.argv = ["hacrl", *req["argv"]]
        try:
            rc = main_fn(req["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - as an uncaught exception ends a cold process
            import traceback

            traceback.print_exc()
            rc = 1
    finally:
        try:  # what a cold process's exit would run: exit handlers, then flushed streams
            import atexit

            atexit._run_exitfuncs()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            conn.send(json.dumps({"exit": rc}).encode())
        except Exception:  # noqa: BLE001
            pass
        os._exit(rc if isinstance(rc, int) else 1)


def _watch(client_pid: int) -> None:
    """Kill this process group when the client dies (no orphan keeps writing after kill -9)."""
    try:
        pidfd = os.pidfd_open(client_pid)
    except (OSError, AttributeError):
        return

    def wait() -> None:
        select.select([pidfd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=wait, daemon=True, name="client-watch").start()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s stage-server: %(message)s",
                        datefmt="%H:%M:%S")
    apply_defaults()
    try:
        serve(Path(sys.argv[1]), sys.argv[2])
    except OSError as e:  # another server won the race for this socket
        log.info("not serving: %s", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
