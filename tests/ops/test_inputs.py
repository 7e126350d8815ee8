"""A stage checks the artifacts it reads against what their producing stages wrote (dvc.lock)
before any work: a damaged or missing input is one line naming the file and the way back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hacrl.hashes import dvc_hash, file_md5
from hacrl.ops.inputs import DamagedInput, verify
from hacrl.pipeline.table import dvc_stage_id
from hacrl.storage import MANIFEST, manifest_of

DVC_YAML = {"stages": {
    "prepare-data": {"cmd": "x", "outs": ["data/tasks"]},
    "generate-rollouts": {"foreach": "${iterations}", "do": {
        "cmd": "x", "deps": ["data/tasks", "runs/it${item.prev}/checkpoints", "src/hacrl/rollout/engine.py"],
        "outs": ["runs/it${item.it}/rollouts"]}},
    "update-policies": {"foreach": "${iterations}", "do": {
        "cmd": "x", "deps": ["runs/it${item.it}/rollouts"], "outs": ["runs/it${item.it}/checkpoints"]}},
}}


def _manifest(path: Path, rel: str, stage: str) -> None:
    it = int(rel.split("/")[1][2:]) if rel.startswith("runs/") else None
    doc = manifest_of(path, {"artifact": rel, "stage": stage, "iteration": it})
    (path / MANIFEST).write_text(json.dumps(doc))


def _workspace(tmp_path: Path) -> Path:
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    files = {"data/tasks/train.jsonl": "{}\n", "runs/it1/checkpoints/a/model.safetensors": "weights",
             "runs/it1/checkpoints/a/config.json": "{}", "runs/it2/rollouts/a.parquet": "rows"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for rel, stage in (("data/tasks", "prepare-data"), ("runs/it1/checkpoints", "update-policies@it1"),
                       ("runs/it2/rollouts", "generate-rollouts@it2")):  # as each stage leaves its directory
        _manifest(tmp_path / rel, rel, stage)
    lock = {"schema": "2.0", "stages": {
        "prepare-data": {"outs": [{"path": "data/tasks", "md5": dvc_hash(tmp_path / "data/tasks")}]},
        "update-policies@it1": {"outs": [{"path": "runs/it1/checkpoints", "md5": dvc_hash(tmp_path / "runs/it1/checkpoints")}]},
    }}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    # DVC's .dir manifest in the cache, as `dvc commit` leaves it
    md5 = lock["stages"]["update-policies@it1"]["outs"][0]["md5"]
    man = tmp_path / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    man.parent.mkdir(parents=True)
    ck = tmp_path / "runs/it1/checkpoints"
    man.write_text(json.dumps([{"md5": file_md5(f), "relpath": f.relative_to(ck).as_posix()}
                               for f in sorted(ck.rglob("*")) if f.is_file()]))
    return tmp_path


def test_intact_inputs_pass_and_stage_names_map_to_dvc():
    assert dvc_stage_id("evaluate", 0) == "evaluate-warmup" and dvc_stage_id("evaluate", 3) == "evaluate@it3"
    assert dvc_stage_id("prepare-pool", 0) == "prepare-pool"


def test_a_damaged_checkpoint_is_named_before_the_stage_reads_it(tmp_path):
    ws = _workspace(tmp_path)
    assert verify(ws, "generate-rollouts@it2") == ["data/tasks", "runs/it1/checkpoints"]
    (ws / "runs/it1/checkpoints/a/model.safetensors").write_text("weightz")  # one byte flipped
    with pytest.raises(DamagedInput) as e:
        verify(ws, "generate-rollouts@it2")
    assert str(e.value) == (f"{ws / 'runs/it1/checkpoints/a/model.safetensors'}: not what update-policies@it1 wrote "
                            "(dvc.lock has another hash): damaged or edited; `dvc checkout --force runs/it1/checkpoints` "
                            "restores it from the cache, `dvc repro update-policies@it1` writes it again")
    (ws / "runs/it1/checkpoints/a/model.safetensors").write_text("weights")
    (ws / "runs/it1/checkpoints/a/extra.bin").write_text("planted")
    with pytest.raises(DamagedInput, match="extra.bin \\(not written by it\\): not what update-policies@it1 wrote"):
        verify(ws, "generate-rollouts@it2")


def _record(ws: Path, stage: str, rel: str) -> None:
    """Record ``rel``'s current content as ``stage``'s output in dvc.lock (what an edit of the lock does)."""
    lock = yaml.safe_load((ws / "dvc.lock").read_text())
    lock["stages"][stage] = {"outs": [{"path": rel, "md5": dvc_hash(ws / rel)}]}
    (ws / "dvc.lock").write_text(yaml.safe_dump(lock))


def test_an_artifact_says_what_it_is_and_a_consumer_checks_it(tmp_path):
    """Issue 29 (2): the lock's hash says the content is what some stage wrote, the manifest says
    which artifact. An input whose producer has no lock entry, another iteration's artifact
    recorded under this name, a directory without a manifest, a file the manifest does not list:
    each one line naming the input, the producer and the way back."""
    import shutil

    ws = _workspace(tmp_path)
    with pytest.raises(DamagedInput) as e:  # written outside DVC: nothing says what it is
        verify(ws, "update-policies@it2")
    assert str(e.value) == ("runs/it2/rollouts: dvc.lock has no record of generate-rollouts@it2 writing it (it ran "
                            "outside DVC, or its entry was removed): `dvc commit generate-rollouts@it2` adopts what is "
                            "there, `dvc repro generate-rollouts@it2` writes it again")
    _record(ws, "generate-rollouts@it2", "runs/it2/rollouts")
    assert verify(ws, "update-policies@it2") == ["runs/it2/rollouts"]
    # iteration 1's rollouts checked out as iteration 2's, the lock edited to match: same hash class, other artifact
    it1 = ws / "runs/it1/rollouts"
    it1.mkdir(parents=True)
    (it1 / "a.parquet").write_text("older rows")
    _manifest(it1, "runs/it1/rollouts", "generate-rollouts@it1")
    shutil.rmtree(ws / "runs/it2/rollouts")
    shutil.copytree(it1, ws / "runs/it2/rollouts")
    _record(ws, "generate-rollouts@it2", "runs/it2/rollouts")
    with pytest.raises(DamagedInput, match=r"^runs/it2/rollouts: holds runs/it1/rollouts \(written by "
                                           r"generate-rollouts@it1\), not generate-rollouts@it2's runs/it2/rollouts: "
                                           r"dvc.lock records another artifact's content under this name"):
        verify(ws, "update-policies@it2")
    # a directory with no manifest (by hand, or an older hacrl)
    (ws / "runs/it2/rollouts" / MANIFEST).unlink()
    _record(ws, "generate-rollouts@it2", "runs/it2/rollouts")
    with pytest.raises(DamagedInput, match=r"^runs/it2/rollouts: no _artifact.json inside: not an artifact a stage "
                                           r"finished .*`dvc repro --force generate-rollouts@it2` writes it again$"):
        verify(ws, "update-policies@it2")
    # its own manifest, and a file it does not list (planted, the lock re-recorded around it)
    _manifest(ws / "runs/it2/rollouts", "runs/it2/rollouts", "generate-rollouts@it2")
    (ws / "runs/it2/rollouts/b.parquet").write_text("planted")
    _record(ws, "generate-rollouts@it2", "runs/it2/rollouts")
    with pytest.raises(DamagedInput, match=r"rollouts/b.parquet: not as generate-rollouts@it2 wrote it \(its "
                                           r"_artifact.json lists other files or sizes\)"):
        verify(ws, "update-policies@it2")


def test_a_broken_dvc_lock_is_one_line_naming_it(tmp_path):
    ws = _workspace(tmp_path)
    text = (ws / "dvc.lock").read_text()
    (ws / "dvc.lock").write_text(text.replace("stages:", "stages: [", 1))
    with pytest.raises(DamagedInput, match=r"^dvc\.lock:\d+: not valid YAML \(.*\); `git checkout dvc.lock` restores"):
        verify(ws, "generate-rollouts@it2")
    (ws / "dvc.lock").write_text("- a list\n")
    with pytest.raises(DamagedInput, match=r"^dvc\.lock: not a mapping \(a list\)$"):
        verify(ws, "generate-rollouts@it2")


def test_a_missing_input_says_which_stage_writes_it(tmp_path):
    ws = _workspace(tmp_path)
    with pytest.raises(DamagedInput) as e:
        verify(ws, "update-policies@it3")
    assert str(e.value) == "runs/it3/rollouts: missing; generate-rollouts@it3 writes it (`dvc repro generate-rollouts@it3`)"
    assert verify(tmp_path / "nowhere", "update-policies@it3") == []  # no dvc.yaml: nothing to check against


def test_hacrl_stage_refuses_a_damaged_input_in_one_line_and_logs_nothing_as_running(tmp_path):
    """Through the CLI, as DVC runs it (DVC_STAGE, DVC_ROOT): exit 2 (no retry), one line, nothing written."""
    from hacrl.pipeline import params

    from conftest import SMOKE

    ws = _workspace(tmp_path)
    params.write_params(params.compose([*SMOKE, "tracking.enabled=false"]), ws / "params.yaml")
    (ws / "runs/it1/checkpoints/a/model.safetensors").write_text("weightz")
    env = {**os.environ, "DVC_STAGE": "generate-rollouts@it2", "DVC_ROOT": str(ws), "HACRL_STAGE_SERVER": "0"}
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", "generate-rollouts", "--iteration", "2"], cwd=ws,
                       env=env, capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        f"hacrl: error: {ws / 'runs/it1/checkpoints/a/model.safetensors'}: not what update-policies@it1 wrote")
    assert not list(ws.rglob(".tmp-*")) and not (ws / "runs" / "it2" / "rollouts" / "gpt2-a.parquet").exists()


def test_inputs_outside_the_repository_are_listed_and_stamped_by_content(tmp_path):
    from hacrl.ops.inputs import stamp
    from hacrl.pipeline import params

    model = tmp_path / "my model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    data = params.compose([f"agents.pool.1.path={model}"])
    assert data["external_inputs"] == {"agent-llama-mid": {"path": str(model)}}
    assert params.compose([])["external_inputs"] == {"none": {"path": "src/hacrl/no_external_input.txt"}}
    params.write_params(data, tmp_path / "params.yaml")
    first = stamp(tmp_path, "agent-llama-mid").read_text()
    assert json.loads(first) == {"input": "agent-llama-mid", "md5": dvc_hash(model)}
    assert stamp(tmp_path, "agent-llama-mid").read_text() == first  # same content, same stamp
    (model / "config.json").write_text('{"n_layer": 2}')
    assert stamp(tmp_path, "agent-llama-mid").read_text() != first
    with pytest.raises(Exception, match="external input 'agent-x': not in dvc.vars.yaml"):
        stamp(tmp_path, "agent-x")


def test_a_damaged_parquet_shard_is_named(tmp_path):
    ws = _workspace(tmp_path)
    lock = yaml.safe_load((ws / "dvc.lock").read_text())
    lock["stages"]["generate-rollouts@it2"] = {"outs": [{"path": "runs/it2/rollouts",
                                                        "md5": dvc_hash(ws / "runs/it2/rollouts")}]}
    (ws / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert verify(ws, "update-policies@it2") == ["runs/it2/rollouts"]
    with open(ws / "runs/it2/rollouts/a.parquet", "ab") as f:
        f.write(b"\x00")  # a truncated or appended shard reads as garbage, or not at all
    with pytest.raises(DamagedInput, match="runs/it2/rollouts: not what generate-rollouts@it2 wrote"):
        verify(ws, "update-policies@it2")


def test_the_report_stage_resolves_params_in_its_paths(tmp_path):
    """`runs/it${experiment.iterations}/history.json` is checked too (not only `${item.*}`)."""
    ws = _workspace(tmp_path)
    spec = yaml.safe_load((ws / "dvc.yaml").read_text())
    spec["stages"]["report"] = {"cmd": "x", "deps": ["runs/it${experiment.iterations}/checkpoints/"]}
    (ws / "dvc.yaml").write_text(yaml.safe_dump(spec))
    lock = yaml.safe_load((ws / "dvc.lock").read_text())
    lock["stages"]["update-policies@it1"]["outs"][0]["path"] = "runs/it1/checkpoints"
    (ws / "dvc.lock").write_text(yaml.safe_dump(lock))
    (ws / "params.yaml").write_text("experiment: {iterations: 1}\n")
    assert verify(ws, "report") == ["runs/it1/checkpoints"]  # the trailing slash normalised too


def test_outputs_dvc_hashed_are_not_read_again_but_an_edit_is(tmp_path, monkeypatch):
    """The input check takes a file's md5 from DVC's own state (recorded when DVC hashed it, by
    inode, mtime and size) rather than read it again; a file edited since is hashed afresh."""
    import subprocess
    import sys
    import time

    import hacrl.hashes as hashes

    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True)
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "weights.bin").write_bytes(b"w" * 100_000)
    (d / "config.json").write_text("{}")
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", "ckpt"], cwd=tmp_path, check=True)
    expected = dvc_hash(d)

    read = []
    real = hashes.file_md5
    monkeypatch.setattr(hashes, "file_md5", lambda p: read.append(p.name) or real(p))
    assert hashes.cached_dvc_hash(tmp_path, d) == expected
    assert read == [], "files DVC had just hashed were read again"

    time.sleep(0.01)
    with open(d / "weights.bin", "r+b") as f:  # in place: another mtime, same size
        f.write(b"x")
    assert hashes.cached_dvc_hash(tmp_path, d) != expected
    assert read == ["weights.bin"]


@pytest.mark.slow
def test_a_stage_run_by_hand_refuses_to_write_under_a_running_dvc_repro_and_dvc_under_it(tmp_path):
    """A `hacrl stage` typed during `dvc repro` of the same workspace would rewrite what DVC records
    (and remove the running stage's temporary files): refused, nothing touched. The reverse: a
    `dvc repro` started while a stage runs by hand cannot take DVC's lock."""
    import time

    from hacrl.ops.dvc_busy import hold_dvc_lock
    from hacrl.pipeline import params

    from conftest import SMOKE, dvc_workspace

    ws = dvc_workspace(tmp_path / "ws", ())
    params.write_params(params.compose([*SMOKE, "tracking.enabled=false"]), ws / "params.yaml")
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"slow": {
        "cmd": f"{sys.executable} -c \"import time, pathlib; time.sleep(20); pathlib.Path('out.txt').write_text('x')\"",
        "outs": ["out.txt"]}}}))
    env = {**os.environ, "HACRL_STAGE_SERVER": "0"}
    repro = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=ws, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and "out.txt" not in ((ws / ".dvc" / "tmp" / "rwlock").read_text()
                                                       if (ws / ".dvc" / "tmp" / "rwlock").exists() else ""):
            time.sleep(0.2)
        (ws / "runs" / ".tmp-planted").mkdir(parents=True)  # what clean_tmp would have removed
        p = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", "prepare-data"], cwd=ws, env=env,
                           capture_output=True, text=True)
        assert p.returncode == 2, p.stderr
        assert "stage run by hand while DVC is at work in this workspace" in p.stderr.strip().splitlines()[-1]
        assert not (ws / "data" / "tasks").exists() and (ws / "runs" / ".tmp-planted").exists()
    finally:
        repro.wait(timeout=120)
    assert repro.returncode == 0 and (ws / "out.txt").exists()
    (ws / "out.txt").unlink()
    with hold_dvc_lock(ws):  # a stage by hand holds the workspace: dvc repro cannot start under it
        p = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=ws, env=env, capture_output=True, text=True)
        assert p.returncode != 0 and "lock" in (p.stdout + p.stderr).lower()
    assert not (ws / "out.txt").exists()
