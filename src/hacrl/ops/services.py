"""``make serve`` / ``make stop``: the local services, on 127.0.0.1 only.

``serve`` starts, each in its own process group (``setsid``) so that ``stop`` can end it and
every child it spawned:

- a Prefect server with a project-local ``PREFECT_HOME`` (``.prefect/``), analytics off;
- work pools ``cpu`` and ``gpu`` (process type; ``gpu`` limited to the number of GPUs), the
  deployments of ``prefect.yaml`` (``hacrl/iterate``, ``hacrl-stage/gpu``) and a worker on
  ``cpu`` (plus one on ``gpu`` when this machine has GPUs);
- the MLflow UI over the project's store (``mlflow.db``, ``mlartifacts/``).

It writes ``.services.env``: ``source`` it in a new shell and the ``prefect`` and ``mlflow``
commands talk to these services. Nothing global (``~/.prefect``, profiles) is touched.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

ENV_FILE = ".services.env"
STATE_DIR = ".services"
HOST = "127.0.0.1"


class ServiceError(RuntimeError):
    """A service did not start (the message names it and its log file)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def gpu_count() -> int:
    """GPUs this machine offers to the policy update (0 without CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def service_env(project: Path, prefect_port: int, mlflow_port: int) -> dict[str, str]:
    """The variables a shell (and every service) needs to reach this project's services."""
    return {
        "PREFECT_HOME": str(project / ".prefect"),
        "PREFECT_API_URL": f"http://{HOST}:{prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # the Prefect CLI's own telemetry banner and events, off as docs/OPERATIONS.md says
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_API_HOST": HOST,
        "PREFECT_SERVER_API_PORT": str(prefect_port),
        # a flow run waits for the next poll before it starts: half a second on average
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        # the server streams flow-run logs to clients: `prefect deployment run --watch` shows the
        # stage lines and the one-line failure, not only state changes
        "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
        "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HACRL_MLFLOW_UI": f"http://{HOST}:{mlflow_port}",
        "HACRL_PROJECT_DIR": str(project),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def env_file_text(env: dict[str, str]) -> str:
    """``.services.env``: every value single-quoted for the shell (a path with a space, a ``$`` or
    a quote stays one literal word; nothing in it runs), the venv's bin put first on PATH."""
    import shlex

    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items() if k != "PATH"]
    lines.append(f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"")
    return "# written by `make serve`; `source` it in a new shell\n" + "\n".join(lines) + "\n"


def client_env(project: str | os.PathLike, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) as a shell that sourced ``.services.env``
    sees it: the running services' variables (from their state file), none of another Prefect's
    or MLflow's, the venv first on PATH. Without running services: ``base`` less those."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    st = _state(Path(project).resolve())
    if st:
        env.update({k: v for k, v in service_env(Path(project).resolve(), st["prefect_port"], st["mlflow_port"]).items()
                    if k != "PATH"})
    return env


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _state(project: Path) -> dict:
    p = project / STATE_DIR / "services.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _start(project: Path, name: str, cmd: list[str], env: dict[str, str]) -> int:
    logs = project / STATE_DIR
    logs.mkdir(exist_ok=True)
    out = open(logs / f"{name}.log", "ab")
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    out.close()
    return proc.pid  # == its process group id (start_new_session)


def _wait_http(url: str, name: str, pgid: int, log_file: Path, timeout_s: float = 90) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not _alive(pgid):
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
    raise ServiceError(f"{name} did not become healthy at {url} within {timeout_s:.0f}s; see {log_file}:\n{tail}")


def _prefect(project: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([_bin("prefect"), "--no-prompt", *args], cwd=project, env=env,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise ServiceError(f"`prefect {' '.join(args)}` failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return p


POOL_DESCRIPTIONS = {
    "cpu": "hacrl: the iterate flow runs and their stages, on this machine (one flow run at a time "
           "holds the workspace lock).",
    "gpu": "hacrl: policy updates routed to GPU workers (deployment hacrl-stage/gpu). Idle, and "
           "not used, while no worker with a GPU polls it: the iterate flow then runs the update "
           "itself (orchestration.gpu_routing=auto).",
}


def _create_pools(env: dict[str, str], limits: dict[str, int | None]) -> None:
    """Create (or reset) process-type work pools with their concurrency limits and a description
    a user sees in the UI (an idle ``gpu`` pool says why it is idle)."""
    for k in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        os.environ[k] = env[k]  # read by Prefect's settings when the client is first built
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    with get_client(sync_client=True) as client:
        for name, limit in limits.items():
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template,
                                                   concurrency_limit=limit, description=POOL_DESCRIPTIONS.get(name)),
                                    overwrite=True)


def serve(project: str | os.PathLike = ".", prefect_port: int = 4200, mlflow_port: int = 5000,
          gpu_workers: int | None = None, mlflow_ui: bool = True) -> dict:
    """Start the services (see the module docstring); return their state (ports, process groups).

    Ports 0 pick free ones. ``gpu_workers`` defaults to 1 on a machine with GPUs, else 0.
    """
    project = Path(project).resolve()
    state = _state(project)
    if any(_alive(pg) for pg in state.get("pgids", {}).values()):
        raise ServiceError(f"services already running ({', '.join(state['pgids'])}); `make stop` first")
    prefect_port = prefect_port or free_port()
    mlflow_port = mlflow_port or free_port()
    for name, port in (("Prefect", prefect_port), ("MLflow UI", mlflow_port if mlflow_ui else None)):
        if port is not None and not _port_free(port):
            raise ServiceError(f"{name} port {HOST}:{port} is in use; pick another "
                               f"(make serve PREFECT_PORT=... MLFLOW_PORT=...)")
    gpus = gpu_count()
    gpu_workers = (1 if gpus else 0) if gpu_workers is None else gpu_workers
    env = {**os.environ, **service_env(project, prefect_port, mlflow_port)}
    (project / ".prefect").mkdir(exist_ok=True)
    state = {"prefect_port": prefect_port, "mlflow_port": mlflow_port, "gpus": gpus, "pgids": {}}
    logs = project / STATE_DIR

    def record() -> None:
        logs.mkdir(exist_ok=True)
        (logs / "services.json").write_text(json.dumps(state, indent=2))

    t0 = time.time()
    try:
        pg = _start(project, "prefect-server", [_bin("prefect"), "server", "start", "--host", HOST,
                                                "--port", str(prefect_port)], env)
        state["pgids"]["prefect-server"] = pg
        record()
        _wait_http(f"http://{HOST}:{prefect_port}/api/health", "Prefect server", pg, logs / "prefect-server.log")
        _create_pools(env, {"cpu": None, "gpu": max(1, gpus)})
        _prefect(project, env, "deploy", "--all")
        state["pgids"]["worker-cpu"] = _start(project, "worker-cpu", [_bin("prefect"), "worker", "start",
                                                                      "--pool", "cpu", "--type", "process"], env)
        for i in range(gpu_workers):
            state["pgids"][f"worker-gpu-{i}"] = _start(project, f"worker-gpu-{i}", [
                _bin("prefect"), "worker", "start", "--pool", "gpu", "--type", "process"], env)
        record()
        if mlflow_ui:
            menv = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
            pg = _start(project, "mlflow-ui", [
                _bin("mlflow"), "server", "--backend-store-uri", env["MLFLOW_TRACKING_URI"],
                "--default-artifact-root", (project / "mlartifacts").as_uri(),
                "--host", HOST, "--port", str(mlflow_port), "--workers", "1"], menv)
            state["pgids"]["mlflow-ui"] = pg
            record()
            _wait_http(f"http://{HOST}:{mlflow_port}/health", "MLflow UI", pg, logs / "mlflow-ui.log")
    except BaseException:
        stop(project)
        raise
    log.info("services up in %.1fs", time.time() - t0)
    (project / ENV_FILE).write_text(env_file_text(service_env(project, prefect_port, mlflow_port)))
    return state


def stop(project: str | os.PathLike = ".", grace_s: float = 10.0) -> list[str]:
    """Stop every service ``serve`` started (their whole process groups); return their names."""
    project = Path(project).resolve()
    state = _state(project)
    stopped = []
    pgids = state.get("pgids", {})
    # workers first, so that no flow run is picked up while the server goes away
    for name in sorted(pgids, key=lambda n: (n == "prefect-server", n)):
        pg = pgids[name]
        if not _alive(pg):
            continue
        os.killpg(pg, signal.SIGTERM)
        deadline = time.time() + grace_s
        while _alive(pg) and time.time() < deadline:
            time.sleep(0.2)
        if _alive(pg):  # some Prefect processes ignore SIGTERM once their server is gone
            os.killpg(pg, signal.SIGKILL)
        stopped.append(name)
    for f in (project / STATE_DIR / "services.json", project / ENV_FILE):
        f.unlink(missing_ok=True)
    return stopped
