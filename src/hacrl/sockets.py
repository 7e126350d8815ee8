"""Unix sockets of the project's long-lived helpers (the stage server, the engine host): a client
that waits for a server it started, and a server that removes only its own socket."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path


def connect(path: Path, kind: int = socket.SOCK_STREAM, wait_s: float = 0.0,
            server: subprocess.Popen | None = None) -> socket.socket | None:
    """A connection to the server at ``path``, waiting up to ``wait_s`` for one to come up (not
    past the exit of ``server``, the process started to serve it, once its socket is gone: a
    server that cannot start costs its first client no more than the attempt)."""
    deadline = time.monotonic() + wait_s
    while True:
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            s.connect(str(path))
            return s
        except OSError:
            s.close()
            if time.monotonic() >= deadline or (server is not None and server.poll() is not None
                                                 and not path.exists()):
                return None
            time.sleep(0.05)


def wait_gone(path: Path, wait_s: float = 5.0) -> None:
    """Until a server that is exiting has removed its socket (at most ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def unlink_own(path: Path, bound_ino: int) -> None:
    """Remove ``path`` if it is still the socket file this server bound (``bound_ino``: its inode,
    taken when it was bound; a newer server may have replaced it). The socket's own descriptor
    cannot tell: ``fstat`` of a socket gives the socket's inode, not the file's, so comparing with
    it left every socket file behind."""
    try:
        if os.stat(path).st_ino == bound_ino:
            path.unlink()
    except OSError:
        pass
