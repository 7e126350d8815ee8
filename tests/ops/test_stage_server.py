"""The warm stage server forks stage processes that behave as cold ones: same artifacts byte
for byte, same exit code and error line, the client's directory and environment; once the code
changed it refuses and exits, and a fresh server serves the stage."""

import hashlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hacrl.ops import stage_server

from conftest import SMOKE


@pytest.fixture()
def env(tmp_path):
    # a server of our own: the key covers HF_* variables
    e = dict(os.environ, HF_HACRL_TEST_KEY=uuid.uuid4().hex, HACRL_LOG_LEVEL="WARNING")
    e["PATH"] = f"{Path(sys.executable).parent}:{e['PATH']}"
    e.pop("HACRL_STAGE_SERVER", None)
    yield e
    subprocess.run([sys.executable, "-c", "import hacrl.cli; from hacrl.ops import stage_server; stage_server.stop()"], env=e)


def _sock(env):
    return Path(subprocess.run([sys.executable, "-c", "import hacrl.cli; from hacrl.ops import stage_server; print(stage_server.socket_path())"],
                               env=env, capture_output=True, text=True, check=True).stdout.strip())


def _stage(ws, env, *args, **kw):
    return subprocess.run(["hacrl", "stage", *args], cwd=ws, env={**env, **kw}, capture_output=True, text=True)


def _tree(d: Path) -> dict:
    return {str(f.relative_to(d)): hashlib.md5(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*")) if f.is_file()}


def _wait_ready(sock: Path, timeout=120):
    t0 = time.time()
    while not sock.exists():
        assert time.time() - t0 < timeout, "the stage server did not come up"
        time.sleep(0.2)


def test_a_served_stage_writes_what_a_cold_one_writes_and_fails_alike(tmp_path, env):
    ws = tmp_path / "ws"
    ws.mkdir()
    subprocess.run([sys.executable, "-m", "hacrl.cli", "config", *SMOKE], cwd=ws, env=env, check=True,
                   capture_output=True)
    cold = _stage(ws, env, "prepare-data", HACRL_STAGE_SERVER="0")
    assert cold.returncode == 0, cold.stderr
    ref = _tree(ws / "data")
    sock = _sock(env)
    assert not sock.exists()
    first = _stage(ws, env, "prepare-data")  # no server yet: starts one, waits, is served
    assert first.returncode == 0 and _tree(ws / "data") == ref
    assert sock.exists()
    warm = _stage(ws, env, "prepare-data")
    assert warm.returncode == 0, warm.stderr
    assert _tree(ws / "data") == ref
    log = sock.with_suffix(".log").read_text()
    assert log.count(f"hacrl stage prepare-data (in {ws})") == 2  # both forked by the server
    # a failure: same exit code and one-line reason as a cold process
    bad_cold = _stage(ws, env, "prepare-data", HACRL_STAGE_SERVER="0", HACRL_FAULT="raise:prepare-data@it0")
    bad_warm = _stage(ws, env, "prepare-data", HACRL_FAULT="raise:prepare-data@it0")
    assert bad_cold.returncode == bad_warm.returncode != 0
    assert "injected fault in prepare-data@it0" in bad_warm.stderr
    assert log.count("hacrl stage prepare-data") < sock.with_suffix(".log").read_text().count("hacrl stage prepare-data")
    # a config error exits 2 with its one line, served or not
    cfg_err = _stage(ws, env, "no-such-stage")
    assert cfg_err.returncode == 2 and "unknown stage 'no-such-stage'" in cfg_err.stderr


def test_a_server_whose_code_changed_refuses_and_a_fresh_one_serves(tmp_path, env):
    ws = tmp_path / "ws"
    ws.mkdir()
    subprocess.run([sys.executable, "-m", "hacrl.cli", "config", *SMOKE], cwd=ws, env=env, check=True,
                   capture_output=True)
    sock = _sock(env)
    _stage(ws, env, "prepare-data")
    _wait_ready(sock)
    src = Path(stage_server.__file__).parents[1] / "lazy.py"
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        r = _stage(ws, env, "prepare-data")
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert r.returncode == 0, r.stderr
    log = sock.with_suffix(".log").read_text()
    stale = log.index("the code changed since this server started: exiting")
    # the old server served the first run only; a fresh one (the new code) served the second
    assert log[:stale].count("hacrl stage prepare-data") == 1
    assert log.count("ready at") == 2 and "hacrl stage prepare-data" in log[stale:]


def test_a_server_that_cannot_start_costs_the_stage_no_wait(tmp_path, env):
    """A server whose imports fail (here a broken ``deepspeed`` ahead on the path) exits; its
    first client notices and runs the stage cold at once, instead of waiting out the start."""
    ws = tmp_path / "ws"
    ws.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "deepspeed.py").write_text("raise ImportError('broken on purpose')\n")
    env = {**env, "PYTHONPATH": f"{broken}:{env.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-m", "hacrl.cli", "config", *SMOKE], cwd=ws, env=env, check=True,
                   capture_output=True)
    t0 = time.time()
    r = _stage(ws, env, "prepare-data")
    assert r.returncode == 0, r.stderr
    assert time.time() - t0 < stage_server.START_WAIT_S / 2
    assert "broken on purpose" in _sock(env).with_suffix(".log").read_text()


def test_a_full_disk_or_file_size_limit_is_one_line_exit_4_and_the_served_stage_obeys_the_callers_ulimit(tmp_path, env):
    """Under the caller's `ulimit -f` (here 16 KB), a stage forked from a server started without it
    still meets the limit: one line naming the file, exit 4 (not retried), nothing renamed into
    place; cold and served alike."""
    import resource

    ws = tmp_path / "ws"
    ws.mkdir()
    subprocess.run([sys.executable, "-m", "hacrl.cli", "config", *SMOKE], cwd=ws, env=env, check=True,
                   capture_output=True)
    assert _stage(ws, env, "prepare-data").returncode == 0  # the server runs, unlimited
    _wait_ready(_sock(env))
    import shutil

    shutil.rmtree(ws / "data")

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))

    for how in ({}, {"HACRL_STAGE_SERVER": "0"}):  # served, then cold
        p = subprocess.run(["hacrl", "stage", "prepare-data"], cwd=ws, env={**env, **how}, capture_output=True,
                           text=True, preexec_fn=limited)
        assert p.returncode == 4, (how, p.stderr[-2000:])
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("hacrl: error: no space left writing ") and "data/tasks" in last, last
        assert "ulimit -f" in last and "nothing was renamed into place" in last
        assert not (ws / "data" / "tasks").exists() and not list(ws.rglob(".tmp-*"))


def test_stop_stops_every_server_of_the_checkout_whatever_its_environment(tmp_path, env):
    """Two servers of this interpreter started with different environment variables (so two
    sockets): `hacrl stop` from a third environment stops both."""
    ws = tmp_path / "ws"
    ws.mkdir()
    subprocess.run([sys.executable, "-m", "hacrl.cli", "config", *SMOKE], cwd=ws, env=env, check=True,
                   capture_output=True)
    other = {**env, "HF_HACRL_TEST_KEY": uuid.uuid4().hex}
    socks = []
    for e in (env, other):
        assert _stage(ws, e, "prepare-data").returncode == 0
        socks.append(_sock(e))
        _wait_ready(socks[-1])
    assert socks[0] != socks[1]
    checkout = Path(sys.prefix).resolve().parent  # the interpreter's venv lives in the checkout
    third = {**env, "HF_HACRL_TEST_KEY": uuid.uuid4().hex}
    p = subprocess.run([sys.executable, "-c", f"import hacrl.cli; from hacrl.ops import stage_server; "
                                              f"print(stage_server.stop_checkout({str(checkout)!r}))"],
                       env=third, capture_output=True, text=True, check=True)
    assert int(p.stdout.strip()) >= 2
    t0 = time.time()
    while any(s.exists() for s in socks) and time.time() - t0 < 30:
        time.sleep(0.2)
    assert not any(s.exists() for s in socks)
    assert not any(s.with_name(s.name + stage_server.ABOUT).exists() for s in socks)
