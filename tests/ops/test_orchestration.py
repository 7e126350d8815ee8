"""The orchestration helpers without Prefect: the workspace lock, one DVC stage at a time with
its exit code, iteration planning errors, MLflow names and DVC hashes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hacrl.hashes import dvc_hash
from hacrl.ops.orchestration import LockBusy, StageFailed, run_dvc_stage, workspace_lock
from hacrl.ops.tracking import flatten, sanitize


def test_lock_refuses_a_second_holder_with_a_clear_message_and_is_released(tmp_path):
    with workspace_lock(tmp_path, 0, holder="flow run A"):
        t0 = time.monotonic()
        with pytest.raises(LockBusy, match=r"another iterate run holds the workspace lock .*flow run A"):
            with workspace_lock(tmp_path, 1.0, holder="flow run B"):
                pass
        assert time.monotonic() - t0 >= 1.0  # it waited for the configured time
    with workspace_lock(tmp_path, 0, holder="flow run B"):  # released on exit
        pass


def test_lock_waits_for_the_holder_to_finish(tmp_path):
    order = []

    def first():
        with workspace_lock(tmp_path, 0, holder="first"):
            order.append("first in")
            time.sleep(1.0)
            order.append("first out")

    th = threading.Thread(target=first)
    th.start()
    time.sleep(0.3)
    with workspace_lock(tmp_path, 30, holder="second"):
        order.append("second in")
    th.join()
    assert order == ["first in", "first out", "second in"]


def test_lock_of_a_killed_holder_is_free(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from hacrl.ops.orchestration import workspace_lock
        from pathlib import Path
        with workspace_lock(Path({str(tmp_path)!r}), 0, holder="doomed"):
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", code])
    assert p.returncode == -9
    with workspace_lock(tmp_path, 0):
        pass


@pytest.fixture()
def dvc_repo(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "ok.py").write_text("open('out.txt', 'w').write('x')\n")
    (tmp_path / "bad.py").write_text("import sys\nprint('hacrl: error: trainer.lr bad')\nsys.exit(2)\n")
    (tmp_path / "crash.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "dvc.yaml").write_text(textwrap.dedent(f"""
        stages:
          ok:
            cmd: {sys.executable} ok.py
            deps: [ok.py]
            outs: [out.txt]
          bad-config:
            cmd: {sys.executable} bad.py
            outs: [never.txt]
          crash:
            cmd: {sys.executable} crash.py
            outs: [never2.txt]
    """))
    return tmp_path


def test_run_dvc_stage_runs_once_then_skips_and_reports_exit_codes(dvc_repo):
    lines = []
    assert run_dvc_stage(dvc_repo, "ok", on_line=lines.append) == "ran"
    assert any("Running stage 'ok'" in ln for ln in lines)
    assert run_dvc_stage(dvc_repo, "ok") == "up-to-date"  # DVC skips it
    assert run_dvc_stage(dvc_repo, "ok", force=True) == "ran"
    (dvc_repo / "out.txt").unlink()
    assert run_dvc_stage(dvc_repo, "ok") == "restored"  # an identical run is in DVC's run cache

    with pytest.raises(StageFailed) as e:
        run_dvc_stage(dvc_repo, "bad-config")
    assert e.value.exit_code == 2 and not e.value.retryable
    assert "trainer.lr bad" in str(e.value) and "bad-config" in str(e.value)
    with pytest.raises(StageFailed) as e:
        run_dvc_stage(dvc_repo, "crash")
    assert e.value.exit_code == 1 and e.value.retryable and "boom" in str(e.value)


def test_a_rwlock_a_killed_dvc_left_unreadable_is_removed_before_dvc_runs(dvc_repo):
    """kill -9 at random moments found it: DVC rewrites .dvc/tmp/rwlock in place, and a dvc killed
    between truncating and writing leaves it empty; every later dvc command then fails. `hacrl
    unlock` (make run) and the orchestrator's dvc calls remove it; a readable one, or one a live
    DVC is editing (rwlock.lock held), is left alone."""
    import fcntl

    from hacrl.ops.dvc_busy import repair_rwlock

    rw = dvc_repo / ".dvc" / "tmp" / "rwlock"
    rw.parent.mkdir(parents=True, exist_ok=True)
    rw.write_text("")  # what the kill leaves
    p = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=dvc_repo, capture_output=True, text=True)
    assert p.returncode != 0 and "JSON structure is corrupted" in p.stdout + p.stderr
    with open(rw.parent / "rwlock.lock", "w") as held:  # DVC editing it right now
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert repair_rwlock(dvc_repo) is None and rw.exists()
    # README: hacrl unlock
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "unlock"], cwd=dvc_repo, capture_output=True, text=True)
    assert p.returncode == 0 and "removed .dvc/tmp/rwlock" in p.stderr and not rw.exists()
    assert run_dvc_stage(dvc_repo, "ok") == "ran"
    rw.write_text('{"write": {}, "read": {}}')
    assert repair_rwlock(dvc_repo) is None and rw.exists()  # readable: DVC's own
    rw.write_text('{"write": {"out.txt": {"pid": 1, "cm')  # cut mid-write: the orchestrator repairs it itself
    assert run_dvc_stage(dvc_repo, "ok") == "up-to-date"


def test_a_dvc_lock_a_killed_dvc_emptied_is_restored_from_the_copy_the_last_stage_kept(dvc_repo):
    """kill -9 at random moments found it too: DVC rewrites dvc.lock in place when a stage ends,
    and a kill then leaves it empty (DVC refuses it: 'validation failed'). Each stage DVC starts
    keeps a copy of the whole lock; `hacrl unlock` and the orchestrator restore it."""
    from hacrl.ops.dvc_busy import LOCK_COPY, keep_lock_copy, repair_after_kill

    assert run_dvc_stage(dvc_repo, "ok") == "ran"
    lock = (dvc_repo / "dvc.lock").read_text()
    keep_lock_copy(dvc_repo)  # what `hacrl stage` does when DVC starts the next stage
    assert (dvc_repo / LOCK_COPY).read_text() == lock
    for cut in ("", lock.split("outs:")[0] + "outs:\n    - pa"):  # emptied, or cut where DVC refuses it
        (dvc_repo / "dvc.lock").write_text(cut)
        p = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=dvc_repo, capture_output=True, text=True)
        assert p.returncode != 0, p.stdout
        p = subprocess.run([sys.executable, "-m", "hacrl.cli", "unlock"], cwd=dvc_repo, capture_output=True, text=True)
        assert "restored the copy taken when the last stage started" in p.stderr, p.stderr
        assert (dvc_repo / "dvc.lock").read_text() == lock
    assert run_dvc_stage(dvc_repo, "ok") == "up-to-date"
    # no copy: said, and left for git
    (dvc_repo / LOCK_COPY).unlink()
    (dvc_repo / "dvc.lock").write_text("")
    assert repair_after_kill(dvc_repo) == ["dvc.lock is empty (a dvc killed while writing it?) and no copy of it is "
                                           "kept here: `git checkout dvc.lock` restores the committed one"]
    assert (dvc_repo / "dvc.lock").read_text() == ""


def test_metric_names_are_sanitised_and_config_is_flattened():
    assert sanitize("eval@it3 (greedy)") == "eval_it3 _greedy_"
    flat = flatten({"a": {"b": 1, "c": [1, 2]}, "agents": [{"name": "x"}, {"name": "y"}]})
    assert flat == {"a.b": "1", "a.c": "[1, 2]", "agents.0.name": "x", "agents.1.name": "y"}


def test_dvc_hash_of_a_file_is_its_md5_and_of_a_folder_is_what_dvc_records(dvc_repo):
    (dvc_repo / "d" / "sub").mkdir(parents=True)
    (dvc_repo / "d" / "a.txt").write_text("alpha")
    (dvc_repo / "d" / "sub" / "b.bin").write_bytes(bytes(range(256)))
    assert dvc_hash(dvc_repo / "d" / "a.txt") == hashlib.md5(b"alpha").hexdigest()
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", "d"], cwd=dvc_repo, check=True)
    recorded = (dvc_repo / "d.dvc").read_text()
    assert f"md5: {dvc_hash(dvc_repo / 'd')}" in recorded, recorded


def test_prefect_retries_only_failures_that_a_retry_can_fix(root, monkeypatch, tmp_path):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.syspath_prepend(str(root))
    from prefect.states import Failed

    from tasks.stages import _retryable

    assert _retryable(None, None, Failed(data=StageFailed("s@it1", 2, "config error"))) is False
    assert _retryable(None, None, Failed(data=StageFailed("s@it1", 3, "non-finite loss"))) is False
    assert _retryable(None, None, Failed(data=StageFailed("s@it1", 1, "crash"))) is True
    assert _retryable(None, None, Failed(data=StageFailed("s@it1", -9, "killed"))) is True


def test_task_logs_keep_the_stage_lines_and_drop_dvc_hints_and_progress_bars():
    from hacrl.ops.orchestration import LOG_LINE_CHARS, task_log_line

    assert task_log_line("Running stage 'evaluate@it1':") == "Running stage 'evaluate@it1':"
    assert task_log_line("21:44:45 INFO hacrl: stage update-policies (iteration 1) finished in 10.1s").endswith("10.1s")
    for noise in ("To track the changes with git, run:", "\tgit add dvc.lock", "\tdvc config core.autostage true",
                  "Use `dvc push` to send your updates to remote storage.", "   ",
                  "eval llama-mid:  50%|█████     | 1/2 [00:00<00:00,  1.86it/s]",
                  "Loading weights:   0%|          | 0/29 [00:00<?, ?it/s]\rLoading weights: 100%|██████████| 29/29 [00:00<00:00, 7720.88it/s]"):
        assert task_log_line(noise) is None, noise
    long = "update a: {" + "'k': 1.0, " * 100 + "}"
    assert len(task_log_line(long)) == LOG_LINE_CHARS + 4


def test_a_task_log_keeps_a_stages_figures_and_warnings_and_its_file_keeps_everything(dvc_repo):
    import logging

    from hacrl.ops.orchestration import stage_seconds, task_summary

    out = ["Running stage 'generate-rollouts@it1':", "> hacrl stage generate-rollouts --iteration 1",
           "05:18:14 INFO hacrl: stage generate-rollouts (iteration 1) started",
           "05:18:14 INFO hacrl: 2 iterations left, about 40 s (the previous iterations' stages)",
           "05:18:16 INFO hacrl.pipeline.stages.generate_rollouts: rollouts gpt2-a: samples 64 · tokens 758",
           "05:18:16 INFO hacrl.rollout.engines: engine host: 2 engines warm",
           "05:18:17 WARNING hacrl.rollout.vllm_engine: vLLM fell back to transformers",
           "05:18:18 INFO hacrl: stage generate-rollouts (iteration 1) finished in 3.3s", "Updating lock file 'dvc.lock'"]
    kept = [task_summary(ln) for ln in out]
    assert [k for k in kept if k] == [
        (logging.INFO, "2 iterations left, about 40 s (the previous iterations' stages)"),
        (logging.INFO, "rollouts gpt2-a: samples 64 · tokens 758"),
        (logging.WARNING, "WARNING hacrl.rollout.vllm_engine: vLLM fell back to transformers")]
    assert stage_seconds(out) == 3.3 and stage_seconds(out[:3]) is None
    assert task_summary("/x/y.py:3: FutureWarning: old") == (logging.WARNING, "FutureWarning: old")
    # run_dvc_stage writes the whole output to the log file it is given; a skip keeps the log of
    # the run that made the outputs; a failure's log is kept
    log_file = dvc_repo / "logs" / "ok.log"
    assert run_dvc_stage(dvc_repo, "ok", force=True, log_file=log_file) == "ran"
    assert "Running stage 'ok'" in log_file.read_text()
    assert run_dvc_stage(dvc_repo, "ok", log_file=log_file) == "up-to-date"
    assert "Running stage 'ok'" in log_file.read_text()
    with pytest.raises(StageFailed):
        run_dvc_stage(dvc_repo, "crash", log_file=dvc_repo / "logs" / "crash.log")
    assert "RuntimeError: boom" in (dvc_repo / "logs" / "crash.log").read_text()
    assert sorted(p.name for p in (dvc_repo / "logs").iterdir()) == ["crash.log", "ok.log"]  # no temporary left
    # a log that cannot be written is said, and the stage runs
    (dvc_repo / "nolog").write_text("a file where the log folder would go")
    assert run_dvc_stage(dvc_repo, "ok", force=True, log_file=dvc_repo / "nolog" / "ok.log") == "ran"


def test_a_stage_that_gave_up_is_logged_as_one_line_and_its_outputs_end_not_a_traceback():
    import logging

    from hacrl.ops.orchestration import ExpectedFailures, IterationFailed

    tail = "05:18:22 INFO hacrl: stage x started\nTraceback (most recent call last):\n  File \"x.py\"\n" \
           "hacrl.cli.InjectedFault: injected fault in exchange-and-align@it2\nERROR: failed to reproduce"
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append((r.getMessage(), r.exc_info, logging.Formatter().format(r)))
    logger = logging.getLogger("test.expected_failures")
    logger.addFilter(ExpectedFailures())
    logger.addHandler(handler)
    try:
        try:
            raise StageFailed("exchange-and-align@it2", 1, tail)
        except StageFailed as e:
            logger.error(f"Task run failed with exception: {e!r} - Retries are exhausted", exc_info=True)
            try:
                raise IterationFailed(2, "exchange-and-align@it2", e.reason) from None
            except IterationFailed as f:
                logger.exception("Encountered exception during execution: %r", f)
        try:
            raise KeyError("k")
        except KeyError:
            logger.error("something else", exc_info=True)
        try:  # an error while handling a stage's failure is news: it keeps its traceback
            try:
                raise StageFailed("evaluate@it1", 1, "boom")
            except StageFailed:
                raise OSError("the tracking store is gone")
        except OSError:
            logger.exception("Encountered exception during execution")
    finally:
        logger.removeHandler(handler)
    (task, _, task_text), (flow, _, flow_text), (other, other_exc, other_text), (_, during, during_text) = records
    assert task == ("Task run failed with exception: stage exchange-and-align@it2 failed (exit 1): "
                    "InjectedFault: injected fault in exchange-and-align@it2 - Retries are exhausted")
    assert task_text == task and flow_text == flow  # no traceback appended
    assert flow == "iteration 2 failed at exchange-and-align@it2: InjectedFault: injected fault in exchange-and-align@it2"
    assert other_exc is not None and "KeyError" in other_text  # not ours: the traceback stays
    assert during is not None and "OSError: the tracking store is gone" in during_text
    # the stage task logs the end of the output itself, each attempt
    from hacrl.ops.orchestration import failure_tail

    shown = failure_tail(StageFailed("exchange-and-align@it2", 1, tail)).splitlines()
    assert shown[0] == "the end of exchange-and-align@it2's output (all of it: logs/exchange-and-align@it2.log):"
    assert shown[-1] == "ERROR: failed to reproduce" and len(shown) <= 13
    from hacrl.ops.orchestration import TaskCompletedEcho

    echo = TaskCompletedEcho()
    mk = lambda m: logging.LogRecord("prefect.task_runs", logging.INFO, "", 0, m, (), None)  # noqa: E731
    assert not echo.filter(mk("Finished in state Completed()")) and echo.filter(mk("Finished in state Failed('x')"))


def test_a_failed_stage_is_one_line_naming_its_own_error():
    from hacrl.ops.launch import flow_failure
    from hacrl.ops.orchestration import IterationFailed, failure_reason

    tail = textwrap.dedent("""\
        Traceback (most recent call last):
          File "x.py", line 3, in <module>
        hacrl.cli.InjectedFault: injected fault in verify-rewards@it2
        ERROR: failed to reproduce 'verify-rewards@it2': failed to run: hacrl stage ..., exited with 1""")
    assert failure_reason(tail) == "InjectedFault: injected fault in verify-rewards@it2"
    assert failure_reason("hacrl: error: trainer.lr: invalid value -1.0\nERROR: failed") == \
        "trainer.lr: invalid value -1.0"
    assert failure_reason("nothing raised\nERROR: failed to reproduce x") == "ERROR: failed to reproduce x"
    assert StageFailed("s@it1", 1, tail).reason == "InjectedFault: injected fault in verify-rewards@it2"
    e = IterationFailed(2, "verify-rewards@it2", "InjectedFault: boom")
    assert str(e) == "iteration 2 failed at verify-rewards@it2: InjectedFault: boom"
    # what Prefect makes of it in the flow run's state message, and back
    assert flow_failure(f"Flow run encountered an exception: IterationFailed: {e}") == str(e)


def test_the_flow_runs_report_links_accuracy_to_checkpoints_and_mlflow(tmp_path):
    from hacrl.ops.orchestration import iteration_markdown
    from hacrl.pipeline import params
    from hacrl.storage import write_json

    from conftest import SMOKE

    cfg = params.from_dict(params.compose(SMOKE))
    write_json(tmp_path / "runs" / "it2" / "eval_metrics.json",
               {"iteration": 2, "agents": {"gpt2-a": {"eval_accuracy": 0.25, "eval_stderr": 0.04, "train_reward": 0.5}}})
    write_json(tmp_path / "runs" / ".tracking" / "runs.json",
               {"experiment_id": "7", "iterations": {"2": "r2"}, "models": {"gpt2-a@it2": "m-1"}})
    md = iteration_markdown(tmp_path, cfg, 2, {"generate-rollouts@it2": "ran"}, "http://127.0.0.1:5000/")
    assert "| gpt2-a | 25.0 % | 4.0 % | 0.500 | `runs/it2/checkpoints/gpt2-a` | " \
           "[gpt2-a-it2](http://127.0.0.1:5000/#/experiments/7/models/m-1?workflowType=machine_learning) |" in md
    assert "| llama-b | – | – | – |" in md  # not evaluated: a dash, not 0
    assert "[iteration run it2](http://127.0.0.1:5000/#/experiments/7/runs/r2?workflowType=machine_learning)" in md
    # every MLflow link opens the machine-learning view
    import re

    links = re.findall(r"\]\((http[^)]*)\)", md)
    assert len(links) >= 4 and all(u.endswith("?workflowType=machine_learning") for u in links)
    assert "generate-rollouts@it2 ran" in md
    # without an MLflow UI: the ids
    assert "gpt2-a-it2 (`m-1`)" in iteration_markdown(tmp_path, cfg, 2, {}, None)


def test_hacrl_iterate_without_services_says_so_and_starts_no_server(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "iterate", "--project", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, env={**env, "HOME": str(tmp_path)})
    assert p.returncode == 1 and p.stderr.strip().startswith("hacrl: error: no Prefect server: run `make serve`")
    assert not list(tmp_path.rglob("*.db"))  # no throwaway Prefect server (and its database)


def test_the_services_env_file_is_quoted_for_the_shell(tmp_path):
    """A project path with a space, a `$(...)` and a quote: sourcing the file gives back the
    exact paths and runs nothing."""
    from hacrl.ops.services import env_file_text, service_env

    project = tmp_path / "my proj $(touch pwned) 'q'"
    project.mkdir()
    env = service_env(project, 4200, 5000)
    f = project / ".services.env"
    f.write_text(env_file_text(env))
    out = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\n" "$MLFLOW_TRACKING_URI" "$PREFECT_HOME" "$PATH"',
                          "_", str(f)], cwd=tmp_path, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    uri, home, path = out.stdout.splitlines()
    assert uri == env["MLFLOW_TRACKING_URI"] == f"sqlite:///{project / 'mlflow.db'}" and home == str(project / ".prefect")
    assert path.startswith(f"{Path(sys.executable).parent}:") and path.endswith(":/usr/bin:/bin")
    assert not list(tmp_path.rglob("pwned"))


def test_the_planner_names_outputs_changed_on_disk(dvc_repo):
    """What `dvc status` says of an output damaged after its stage ran: the flow logs it (the
    stage is then restored from DVC's run cache or run again) instead of repairing it silently."""
    from hacrl.ops.orchestration import changed_outputs, dvc_status

    run_dvc_stage(dvc_repo, "ok")
    assert changed_outputs(dvc_status(dvc_repo)) == {}
    (dvc_repo / "out.txt").write_text("damaged\n")
    assert changed_outputs(dvc_status(dvc_repo)) == {"ok": {"out.txt": "modified"}}
    assert run_dvc_stage(dvc_repo, "ok") in ("ran", "restored")
    assert changed_outputs(dvc_status(dvc_repo)) == {}


def test_dvc_subprocesses_do_not_inherit_the_project_on_pythonpath(tmp_path, monkeypatch):
    """Prefect's process worker puts the deployment's directory on PYTHONPATH; a stage process
    with it would not share the warm stage server of a shell's `dvc repro` (its key includes
    PYTHON*), so each flow run's first stage waited for a server of its own."""
    from hacrl.ops.orchestration import dvc_env

    other = tmp_path / "plugins"
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{other}")
    assert dvc_env(project=tmp_path)["PYTHONPATH"] == str(other)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert "PYTHONPATH" not in dvc_env(project=tmp_path)
    assert dvc_env()["PYTHONPATH"] == str(tmp_path)  # no project named: as it was


def test_hacrl_iterate_ends_with_the_iterations_result(tmp_path, monkeypatch):
    """The last lines of `hacrl iterate`: held-out accuracy per agent with the change since the
    previous iteration, and the MLflow page (machine-learning view)."""
    from hacrl.ops.launch import result_lines
    from hacrl.pipeline import params
    from hacrl.storage import write_json

    from conftest import SMOKE

    params.write_params(params.compose([*SMOKE, "tracking.enabled=true",
                                        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]), tmp_path / "params.yaml")
    write_json(tmp_path / "runs" / "it1" / "eval_metrics.json", {"agents": {"gpt2-a": {"eval_accuracy": 0.25},
                                                                          "llama-b": {"eval_accuracy": 0.5}}})
    write_json(tmp_path / "runs" / "it2" / "eval_metrics.json", {"agents": {"gpt2-a": {"eval_accuracy": 0.3},
                                                                          "llama-b": {"eval_accuracy": 0.45}}})
    monkeypatch.setenv("HACRL_MLFLOW_UI", "http://127.0.0.1:5000")
    lines = result_lines(tmp_path, 2)
    assert lines[0] == "held-out accuracy after iteration 2: gpt2-a 30.0 % (+5.0), llama-b 45.0 % (-5.0)"
    assert lines[1].startswith("MLflow: http://127.0.0.1:5000/#/experiments/") and \
        lines[1].endswith("/runs?workflowType=machine_learning")
    assert result_lines(tmp_path, 3) == []  # not evaluated: nothing claimed


def test_hacrl_iterate_says_what_an_override_makes_stale_before_it_starts(tmp_path):
    import shutil

    from hacrl.ops.launch import override_effect
    from hacrl.pipeline import params

    from conftest import ROOT, SMOKE

    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    params.write_params(params.compose(SMOKE), tmp_path / "params.yaml")
    assert override_effect(tmp_path, params.compose(SMOKE)) == []  # nothing changes, nothing said
    lines = override_effect(tmp_path, params.compose([*SMOKE, "trainer.lr=1e-4"]))
    assert lines[0].startswith("overrides change 1 setting(s): trainer.lr 0.0005 -> 0.0001"), lines
    assert "update-policies" in lines[1] and "generate-rollouts" not in lines[1]
    assert "this run redoes iteration 1" in lines[1] and "hacrl.supersedes" in lines[2]
    lines = override_effect(tmp_path, params.compose([*SMOKE, "data.max_operand=50"]))
    assert "prepare-data" in lines[1] and "the pool is prepared again" in lines[1]


def test_an_iteration_starts_with_the_time_left_from_the_previous_ones_stages(tmp_path):
    """Issue 28 (8): the estimate comes from the stages that really ran (runs/.timing.json, which
    DVC neither tracks nor restores); none for the first iteration or an incomplete record."""
    from hacrl.ops import progress

    stages = ("generate-rollouts", "update-policies")
    assert progress.eta(tmp_path, 2, 6, stages) is None  # nothing recorded
    progress.record(tmp_path, "generate-rollouts", 1, 20.0)
    assert progress.eta(tmp_path, 2, 6, stages) is None  # iteration 1 not complete
    progress.record(tmp_path, "update-policies", 1, 40.04)
    assert progress.eta(tmp_path, 2, 6, stages) == "iteration 2/6: about 5 min left (iteration 1 took 60 s)"
    assert progress.eta(tmp_path, 6, 6, stages) is None  # iteration 5 has no record
    assert progress.eta(tmp_path, 1, 6, stages) is None
    (tmp_path / progress.TIMING).write_text("not json")
    assert progress.eta(tmp_path, 2, 6, stages) is None  # a damaged record is no estimate, not an error
