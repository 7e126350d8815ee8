"""What an orchestrator needs to drive the DVC pipeline one iteration at a time.

Prefect's ``hacrl/iterate`` flow (``flows/iterate.py``) is a thin layer over these functions:
plan the next iteration from ``dvc status``, hold the workspace lock, and run each stage through
``dvc repro --single-item`` so that ``dvc.lock`` records it and ``dvc repro`` never redoes it.
Nothing here imports Prefect; it is tested on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hacrl.config.build import read_yaml
from hacrl.errors import ConfigError
from hacrl.pipeline import table
from hacrl.pipeline.params import compose, from_dict, keep_extension, read_params, set_iterations, write_params
from hacrl.pipeline.table import INPUT_STAGE, stage_id
from hacrl.resources import plan_for

log = logging.getLogger(__name__)

LOCK_FILE = ".hacrl-iterate.lock"
NO_RETRY_EXIT_CODES = (2, 3, 4)
"""``hacrl stage`` exit codes of a config/data error (2), a non-finite loss (3) and a full disk or
file-size limit (4): retrying would fail the same way."""


def stage_devices(cfg, stage: str, p=None) -> tuple[str, ...]:
    """The devices the MWRA plan (``p``, else the config's) gives the jobs of ``dvc.yaml`` stage
    ``stage`` (none for a stage without a device job; which jobs a stage carries out is its row
    of the stage table)."""
    row = table.of_dvc_stage(stage)
    if row is None or row.jobs is None:
        return ()
    p = p or plan_for(cfg)
    ids = [d.id for d in cfg.resources.devices]
    return tuple(sorted({d for j in p.jobs(row.jobs) for d in j.devices}, key=ids.index))


def device_tags(devices: tuple[str, ...]) -> list[str]:
    """A stage task's Prefect tags for the devices it holds: GPUs and CPU shares (``device:cuda:0``).
    Each such tag has a concurrency limit of 1, so two flow runs (two experiments on one host)
    never hold a device at once. The whole CPU host is not tagged: it is shared by time."""
    return [f"device:{d}" for d in devices if d != "cpu"]


def gpu_stages(cfg) -> tuple[str, ...]:
    """``dvc.yaml`` stages routed to the GPU work pool: those the stage table marks ``gpu`` (the
    update) always, and every stage whose jobs the plan puts on a GPU (evaluate-warmup included)."""
    p = plan_for(cfg)
    return tuple(s for s in (*table.prepare_stages(), *table.iteration_stages())
                 if table.of_dvc_stage(s).gpu or any(d.startswith("cuda:") for d in stage_devices(cfg, s, p)))


class StageFailed(RuntimeError):
    """A stage's ``dvc repro`` failed; carries the stage, the exit code and the output's tail."""

    def __init__(self, stage: str, exit_code: int | None, tail: str) -> None:
        self.stage, self.exit_code, self.tail = stage, exit_code, tail
        code = f"exit {exit_code}" if exit_code is not None else "no exit code"
        # one line (Prefect repeats it in the task's state message); the tail is kept apart
        super().__init__(f"stage {stage} failed ({code}): {self.reason}")

    @property
    def retryable(self) -> bool:
        return self.exit_code not in NO_RETRY_EXIT_CODES

    @property
    def reason(self) -> str:
        """The failure in one line: the stage's own error (``hacrl: error: ...`` or the
        exception that ended it), else the last line DVC printed."""
        return failure_reason(self.tail) or f"exit {self.exit_code}"


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Fault|Failed|Interrupt|Exit))(?::\s*(.*))?$")


def failure_reason(output: str) -> str:
    """One line saying why a stage failed, from its output: the last ``hacrl: error:`` line or
    Python exception line (module path dropped), else the last non-empty line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("hacrl: error:"):
            return ln.removeprefix("hacrl: error:").strip()
        m = _EXCEPTION_LINE.match(ln)
        if m:
            return f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
    return lines[-1][:LOG_LINE_CHARS] if lines else ""


class IterationFailed(RuntimeError):
    """An iteration stopped at a stage; the message is one line: the stage and the reason."""

    def __init__(self, t: int | None, stage: str, reason: str) -> None:
        self.iteration, self.stage, self.reason = t, stage, reason
        super().__init__(f"{'preparation' if t is None else f'iteration {t}'} failed at {stage}: {reason}")


class LockBusy(RuntimeError):
    """Another iterate run holds the workspace lock."""


TAIL_LINES = 12
"""How many of a failed stage's last output lines its task's log shows (all of them: ``logs/STAGE.log``)."""


def _expected(exc: BaseException | None) -> BaseException | None:
    """The failure this project raised on purpose, with a complete message: ``exc`` or what it was
    raised from (not an exception that happened while handling one: that keeps its traceback)."""
    from hacrl.errors import DataError

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, (StageFailed, IterationFailed, LockBusy, ConfigError, DataError)):
            return exc
        exc, seen = exc.__cause__, seen + 1
    return None


def failure_tail(e: StageFailed) -> str:
    """The end of a failed stage's output, as its task's log shows it."""
    tail = [ln for ln in e.tail.splitlines() if ln.strip()][-TAIL_LINES:]
    return f"the end of {e.stage}'s output (all of it: {STAGE_LOG_DIR}/{e.stage}.log):\n" + "\n".join(tail)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, (StageFailed, IterationFailed, LockBusy)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class ExpectedFailures(logging.Filter):
    """Prefect logs a failed task or flow with the exception's repr and a traceback through its own
    engine (~120 lines). For the failures this project raises on purpose, whose message is complete
    (a stage's exit and its own error, a config or data error, a busy workspace), the record keeps
    one line naming the failure and the traceback goes (the stage task logs the end of the stage's
    output itself: :func:`failure_tail`). Other exceptions keep theirs. Installed on Prefect's run
    loggers by the tasks module (``tasks/stages.py``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None and isinstance(record.args, tuple):
            exc = next((a for a in record.args if isinstance(a, BaseException)), None)
        known = _expected(exc)
        if known is None:
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed call is logging's to report, not ours
            return True
        for x in {exc, known}:
            text = text.replace(repr(x), _one_line(known))
        if "Encountered exception during execution" in text:  # the flow run's end: the reason is the news
            text = _one_line(known)
        record.msg, record.args = text, ()
        record.exc_info = record.exc_text = None
        return True


class TaskCompletedEcho(logging.Filter):
    """Drops a task run's ``Finished in state Completed()`` log line: the run's Completed event
    says it on the line before, in the UI and under ``--watch`` (failures keep theirs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "Finished in state Completed()" and not record.args)


def extend_to(project: Path, n: int) -> dict:
    """Rewrite params.yaml with ``n`` iterations, everything else as it is.

    The current params.yaml is kept (including the overrides it was composed with); only the
    iteration count and DVC's ``iterations`` table change (:func:`hacrl.pipeline.params.set_iterations`),
    which no stage depends on: nothing finished becomes stale.
    """
    data = set_iterations(read_params(project), n)
    from_dict(data)
    write_params(data, project / "params.yaml")
    return data


def dvc_env(extra: dict[str, str] | None = None, project: Path | None = None) -> dict[str, str]:
    """The environment of a DVC subprocess: this interpreter's bin first (``hacrl`` and ``dvc``).

    ``project``'s own directory is taken off ``PYTHONPATH``: Prefect's process worker puts the
    deployment's directory there for the flow, which imports its modules by path anyway, and
    a stage process with it would not match the warm stage server (and engine processes) that
    ``dvc repro`` from a shell uses: measured, the first stage of every flow run then waited for
    a stage server of its own to import everything."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if project is not None and env.get("PYTHONPATH"):
        here = Path(project).resolve()
        kept = [p for p in env["PYTHONPATH"].split(os.pathsep) if p and Path(p).resolve() != here]
        if kept:
            env["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            env.pop("PYTHONPATH")
    env.update(extra or {})
    return env


def dvc_status(project: Path) -> dict:
    """``dvc status --json``: stage -> what changed (deps, outs, params)."""
    p = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=project,
                       env=dvc_env(project=project), capture_output=True, text=True)
    if p.returncode != 0:
        raise StageFailed("dvc status", p.returncode, (p.stdout + p.stderr)[-3000:])
    out = p.stdout.strip()
    return json.loads(out) if out else {}


def stale_stages(project: Path) -> set[str]:
    """Names of the stages ``dvc status`` reports as changed (missing outputs included)."""
    return set(dvc_status(project))


def changed_outputs(status: dict) -> dict[str, dict[str, str]]:
    """Per stage, the outputs that differ on disk from what DVC recorded (damaged or edited since
    the stage wrote them), from :func:`dvc_status`'s answer. Missing outputs are left out: a
    stage that never ran has them too."""
    out: dict[str, dict[str, str]] = {}
    for stage, changes in status.items():
        for ch in changes if isinstance(changes, list) else []:
            if isinstance(ch, dict) and isinstance(ch.get("changed outs"), dict):
                mod = {p: why for p, why in ch["changed outs"].items() if why == "modified"}
                if mod:
                    out.setdefault(stage, {}).update(mod)
    return out


@dataclass
class Plan:
    """What one iterate run will do."""

    iteration: int | None
    """None: prepare first (``prepare``), then plan again."""
    configured: int
    """``experiment.iterations`` after the plan (grown by one when every iteration was done)."""
    prepare: bool
    """Whether the preparation stages (data, pool, warm-up eval) must run first."""
    extended: bool
    stale: set[str]
    inputs: list[str] = dataclasses.field(default_factory=list)
    """The ``external-input@KEY`` stages to run first (an input outside the repository changed)."""
    changed: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    """Stage -> its outputs modified on disk since DVC recorded them: the run restores them (DVC's
    run cache) or writes them again when it reaches that stage."""


def plan_iteration(project: Path, iteration: int | None = None, overrides: list[str] | None = None) -> Plan:
    """Choose the iteration to run: ``iteration`` if given, else the first one not yet done.

    When every configured iteration is done, the experiment grows by one (params.yaml's
    ``experiment.iterations``, hence dvc.yaml's ``foreach``). When an input, the data or the pool
    must be prepared first, no iteration is chosen yet (``Plan.iteration`` is None): which ones
    that makes stale is known only once they ran, so plan again then. Call under
    :func:`workspace_lock`.
    """
    if overrides:
        data = compose(overrides)
        keep_extension(data, overrides, project / "params.yaml")
        write_params(data, project / "params.yaml")
    n = int(read_params(project)["experiment"]["iterations"])
    from hacrl.ops.dvc_busy import repair_after_kill

    for repaired in repair_after_kill(project):
        log.warning("%s", repaired)
    status = dvc_status(project)
    stale = set(status)
    inputs = sorted(s for s in stale if s.startswith(INPUT_STAGE + "@"))
    if inputs or any(s in stale for s in table.prepare_stages()):
        return Plan(None, n, True, False, stale, inputs, changed_outputs(status))
    iteration = _choose(n, stale, iteration)
    extended = iteration == n + 1
    if extended:
        extend_to(project, iteration)
        n = iteration
        stale = stale_stages(project)
    return Plan(iteration, n, False, extended, stale, [], changed_outputs(status))


def next_iteration(project: Path, iteration: int | None = None) -> int | None:
    """The iteration an iterate run would take now (:func:`plan_iteration` without writing
    anything: the flow run gets its name, ``iterate-itT``, when it is created); None when the
    inputs, data or pool must be prepared first (the iteration is chosen after that)."""
    n = int(read_params(project)["experiment"]["iterations"])
    stale = stale_stages(project)
    if any(s.startswith(INPUT_STAGE + "@") or s in table.prepare_stages() for s in stale) and _prepared_before(project):
        return None  # the pool may change: which iterations stay done is known once it ran
    return _choose(n, stale, iteration)


def _prepared_before(project: Path) -> bool:
    """Whether the pool was ever built here (dvc.lock has prepare-pool): a first run's pool
    makes every iteration to do, so the first is iteration 1 (or the one asked for)."""
    lock = project / "dvc.lock"
    return lock.is_file() and "prepare-pool" in ((read_yaml(lock) or {}).get("stages") or {})


def _choose(n: int, stale: set[str], iteration: int | None) -> int:
    pending = [t for t in range(1, n + 1) if any(stage_id(s, t) in stale for s in table.iteration_stages())]
    if iteration is None:
        iteration = pending[0] if pending else n + 1
    if iteration < 1:
        raise ConfigError(f"iteration: invalid value {iteration} (RL iterations start at 1)")
    earlier = [t for t in pending if t < iteration]
    if earlier:
        raise ConfigError(f"iteration: invalid value {iteration} (iteration {earlier[0]} is not done; "
                          f"run it first, or leave the iteration unset)")
    if iteration > n + 1:
        raise ConfigError(f"iteration: invalid value {iteration} (only {n} configured and done; "
                          f"the next one is {n + 1})")
    return iteration


@contextlib.contextmanager
def workspace_lock(project: Path, timeout_s: float, holder: str = "") -> Iterator[None]:
    """Hold the workspace's iterate lock; wait up to ``timeout_s``, then raise :class:`LockBusy`.

    ``flock`` is released by the kernel when the holder dies, so a killed run never leaves a
    stale lock behind.
    """
    path = project / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    other = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown holder"
                    raise LockBusy(f"another iterate run holds the workspace lock {path} ({other}); "
                                   f"waited {timeout_s:.0f}s. Wait for it, or raise "
                                   f"orchestration.lock_timeout_s") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} {holder}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


DVC_HINTS = ("To track the changes with git, run:", "git add dvc.lock", "To enable auto staging, run:",
             "dvc config core.autostage true", "Use `dvc push` to send your updates to remote storage.")
"""What ``dvc repro`` prints after every stage: said once per run in the README, not in every task log."""
_TQDM = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")
LOG_LINE_CHARS = 400


def task_log_line(line: str) -> str | None:
    """A line of a stage's output as a task log shows it: None for DVC's after-run hints and for
    progress bars (tqdm redraws; the stage logs its start, end and figures), long lines cut."""
    line = line.rsplit("\r", 1)[-1].rstrip()
    if not line.strip() or line.strip() in DVC_HINTS or _TQDM.search(line):
        return None
    return line if len(line) <= LOG_LINE_CHARS else line[:LOG_LINE_CHARS] + " ..."


_LOG_RECORD = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)$")
_START_END = re.compile(r"^stage \S+ \(iteration \d+\) (started|finished in ([\d.]+)s)$")
STAGE_LOG_DIR = "logs"
"""Where an orchestrated stage's whole output goes (``logs/<stage>.log``, rewritten by each run of
the stage, not versioned): the task's log in Prefect keeps its figures and warnings."""


_PY_WARNING = re.compile(r"^\S.*:\d+: (\w*Warning): (.*)$")


def task_summary(line: str) -> tuple[int, str] | None:
    """A line of a stage's output as the task's log in Prefect keeps it, with its level: the
    stage's figures (INFO lines of ``hacrl`` and the stage modules, the time stamp and logger
    dropped: Prefect stamps its own) and every warning or error (Python's ``warnings`` too); None
    for the rest (DVC's lines, the start and end lines, other modules' chatter), which stay in the
    stage's log file."""
    shown = task_log_line(line)
    w = _PY_WARNING.match(shown or "")
    if w is not None:
        return logging.WARNING, f"{w.group(1)}: {w.group(2)}"
    m = _LOG_RECORD.match(shown or "")
    if m is None:
        return None
    level, name, msg = logging.getLevelName(m.group(1)), m.group(2), m.group(3)
    if level >= logging.WARNING:
        return level, f"{m.group(1)} {name}: {msg}"
    if level == logging.INFO and (name == "hacrl" or name.startswith("hacrl.pipeline.stages.")) \
            and not _START_END.match(msg):
        return level, msg
    return None


def stage_seconds(lines: list[str]) -> float | None:
    """The wall time ``hacrl stage`` said it took (its ``finished in`` line), if it said so."""
    for ln in reversed(lines):
        m = _LOG_RECORD.match(ln.strip())
        e = _START_END.match(m.group(3)) if m else None
        if e and e.group(2):
            return float(e.group(2))
    return None


def run_dvc_stage(project: Path, stage: str, force: bool = False, env: dict[str, str] | None = None,
                  on_line: Callable[[str], None] | None = None, log_file: Path | None = None) -> str:
    """``dvc repro --single-item STAGE``; returns ``ran``, ``restored`` (DVC's run cache had
    the outputs of an identical earlier run) or ``up-to-date``.

    Output lines go to ``on_line`` as they come (progress bars and DVC's hints left out), and
    every line to ``log_file`` when given; on failure :class:`StageFailed` carries the stage's
    exit code (parsed from DVC's message) and the last lines.
    """
    from hacrl.ops.dvc_busy import repair_after_kill

    for repaired in repair_after_kill(project):  # a dvc killed mid-write (a retried task) leaves it unreadable
        log.warning("%s", repaired)
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage] + (["--force"] if force else [])
    proc = subprocess.Popen(cmd, cwd=project, env=dvc_env(env, project), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    assert proc.stdout is not None
    out = _StageLog(log_file)
    try:
        for line in proc.stdout:
            out.write(line)
            line = line.rstrip("\n")
            lines.append(line)
            shown = task_log_line(line) if on_line is not None else None
            if shown is not None:
                on_line(shown)
        rc = proc.wait()
    except BaseException:  # a dvc left running (blocked on its pipe) would hold DVC's lock
        proc.kill()
        proc.wait()
        out.close(keep=False)
        raise
    text = "\n".join(lines)
    ran = f"Running stage '{stage}'" in text
    out.close(keep=ran or rc != 0)  # a skipped stage keeps the log of the run that made its outputs
    if rc != 0:
        m = re.search(r"exited with (-?\d+)", text)
        code = int(m.group(1)) if m else None
        errors = [ln for ln in lines[:-15] if "error" in ln.lower()][-5:]  # earlier than the last lines
        tail = "\n".join(errors + lines[-15:])
        raise StageFailed(stage, code, tail)
    if ran:
        return "ran"
    return "restored" if f"Stage '{stage}' is cached" in text else "up-to-date"


class _StageLog:
    """A stage's whole output, written beside its final name and renamed there when kept; best
    effort (a log that cannot be written is said once, and the stage goes on)."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.f = path, None
        if path is None:
            return
        self.tmp = path.with_name(f".{path.name}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(self.tmp, "w")
        except OSError as e:
            log.warning("the stage's output is not kept in %s: %s", path, e)

    def write(self, line: str) -> None:
        if self.f is None:
            return
        try:
            self.f.write(line)
            self.f.flush()
        except OSError as e:
            log.warning("the stage's output is not kept in %s: %s", self.path, e)
            self.close(keep=False)

    def close(self, keep: bool) -> None:
        if self.f is None:
            return
        f, self.f = self.f, None
        with contextlib.suppress(OSError):
            f.close()
            if keep:
                os.replace(self.tmp, self.path)
        with contextlib.suppress(OSError):
            self.tmp.unlink(missing_ok=True)


def iteration_markdown(project: Path, cfg, t: int, stages: dict[str, str], mlflow_ui: str | None = None) -> str:
    """The flow run's report of iteration ``t`` (a Prefect markdown artifact): held-out accuracy
    per agent with its checkpoint, what each stage did, and links to the MLflow runs and models
    (``mlflow_ui``: the MLflow UI's URL; without one, the run and model ids)."""
    from hacrl.storage import RunLayout, read_json

    lay = RunLayout(project / cfg.experiment.runs_dir)
    metrics = read_json(lay.eval_metrics(t)) if lay.eval_metrics(t).exists() else {"agents": {}}
    ptr = lay.runs / ".tracking" / "runs.json"
    runs = read_json(ptr) if ptr.exists() else {}
    eid = runs.get("experiment_id")
    ui = (mlflow_ui or "").rstrip("/")

    def link(text: str, route: str | None, ident: str | None) -> str:
        if ui and eid and route is not None:
            from hacrl.ops.tracking import ui_link

            return f"[{text}]({ui_link(ui, f'/experiments/{eid}{route}')})"
        return f"{text} (`{ident}`)" if ident else text

    lines = [f"# {cfg.experiment.name}: iteration {t} ({cfg.algorithm.name})", "",
             "| agent | held-out accuracy | standard error | training reward | checkpoint | MLflow model |",
             "|---|---:|---:|---:|---|---|"]
    for a in cfg.agents:
        m = metrics["agents"].get(a.name, {})
        pct = lambda k: f"{100 * m[k]:.1f} %" if k in m else "–"  # noqa: E731
        reward = f"{m['train_reward']:.3f}" if "train_reward" in m else "–"
        mid = runs.get("models", {}).get(f"{a.name}@it{t}")
        model = link(f"{a.name}-it{t}", f"/models/{mid}", mid) if mid else "–"
        lines.append(f"| {a.name} | {pct('eval_accuracy')} | {pct('eval_stderr')} | {reward} | "
                     f"`{cfg.experiment.runs_dir}/it{t}/checkpoints/{a.name}` | {model} |")
    lines += ["", "Stages: " + ", ".join(f"{s} {what}" for s, what in stages.items()), ""]
    it_run = runs.get("iterations", {}).get(str(t))
    mlflow_links = [link("training runs (one line per agent)", "/runs", eid),
                    link(f"iteration run it{t}", f"/runs/{it_run}", it_run) if it_run else None,
                    link("every checkpoint (the Models tab: one logged model per agent and iteration, newest first)",
                         "/models", None) if ui and eid else None]
    lines.append("MLflow: " + " · ".join(x for x in mlflow_links if x))
    return "\n".join(lines) + "\n"
