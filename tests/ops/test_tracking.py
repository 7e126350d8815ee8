"""MLflow as its users browse it, over the real (sqlite) store: one run per agent holding its
series at steps 0..T, one run per iteration nested in the experiment's run, every checkpoint a
logged model with its held-out figures linked to it and to the held-out dataset, registered
versions with itT aliases, and a new experiment run when the config changes the results.

The stage results here are written by hand (the files they point at exist, with made-up
content): what is tested is what tracking makes of any stage's result; the real stages'
results reach MLflow in tests/pipeline/test_e2e_dvc.py."""

import json
from pathlib import Path

import pytest
from conftest import SMOKE

from hacrl.hashes import dvc_hash
from hacrl.ops.tracking import Tracker
from hacrl.pipeline import params
from hacrl.pipeline.result import Input, Series, StageResult
from hacrl.storage import RunLayout, read_json

AGENTS = ("gpt2-a", "llama-b")


def _cfg(tmp_path: Path, *extra: str):
    cfg = params.from_dict(params.compose([*SMOKE, "tracking.enabled=true", *extra]))
    cfg.tracking.uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return cfg


def _checkpoints(lay: RunLayout, t: int, salt: str = "") -> dict[str, str]:
    out = {}
    for a in AGENTS:
        d = lay.checkpoint(t, a)
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.safetensors").write_text(f"{a} {t} {salt}")
        out[a] = str(d)
    return out


def _iteration(tr: Tracker, lay: RunLayout, t: int, acc: dict[str, float], salt: str = "") -> None:
    """What the stages of iteration t report (t = 0: the pool and its first evaluation)."""
    ms = 1_000_000 * (t + 1)
    if t == 0:
        tr.log_stage("prepare-pool", 0, StageResult({}, agents={a: {"params": 1000.0} for a in AGENTS},
                                                     checkpoints=_checkpoints(lay, 0, salt)), 2.0,
                     start_ms=ms, end_ms=ms + 2000)
    else:
        for a in AGENTS:
            for kind in ("rollouts", "rewards"):
                (lay.it(t) / kind).mkdir(parents=True, exist_ok=True)
                (lay.it(t) / kind / f"{a}.parquet").write_text(f"{kind} {a} {t}")
        tr.log_stage("verify-rewards", t, StageResult({}, agents={a: {"reward_mean": 0.1 * t} for a in AGENTS},
                                                       metrics={"fast_path_verdicts": 7}), 1.0,
                     start_ms=ms, end_ms=ms + 1000)
        inputs = [Input(f"{k}/it{t}/{a}", str(lay.it(t) / k / f"{a}.parquet"), "training")
                  for k in ("rollouts", "rewards") for a in AGENTS]
        tr.log_stage("update-policies", t, StageResult(
            {}, agents={a: {"train_entropy": 1.0 / t, "train_clip_frac": 0.05} for a in AGENTS},
            series={a: Series(4 * (t - 1), {"train_update_loss": [0.5, None, 0.25, 0.125]}) for a in AGENTS},
            inputs=inputs, checkpoints=_checkpoints(lay, t, salt)), 3.0, start_ms=ms + 1000, end_ms=ms + 4000)
    held = lay.tasks / "heldout.jsonl"
    held.parent.mkdir(parents=True, exist_ok=True)
    held.write_text('{"id": "h1"}\n')
    tr.log_stage("evaluate", t, StageResult(
        {}, evaluation={a: {"eval_accuracy": acc[a], "eval_stderr": 0.01} for a in AGENTS},
        agents={a: {"rescued_now_accuracy": 0.5} for a in AGENTS},
        evaluated={a: str(lay.checkpoint(t, a)) for a in AGENTS},
        dataset=Input("heldout", str(held), "evaluation")), 1.5, start_ms=ms + 4000, end_ms=ms + 5500)


@pytest.fixture()
def tracked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path)
    lay = RunLayout(cfg.experiment.runs_dir)
    tr = Tracker(cfg, tmp_path)
    accs = [{"gpt2-a": 0.1, "llama-b": 0.2}, {"gpt2-a": 0.3, "llama-b": 0.1}, {"gpt2-a": 0.5, "llama-b": 0.4}]
    for t, acc in enumerate(accs):
        _iteration(tr, lay, t, acc)
    return tmp_path, cfg, lay, tr, accs


def test_each_agent_is_one_run_with_its_series_at_steps_0_to_T(tracked):
    tmp_path, cfg, lay, tr, accs = tracked
    c = tr.client
    runs = c.search_runs([tr.experiment_id], "tags.`hacrl.kind` = 'agent'")
    assert sorted(r.data.tags["hacrl.agent"] for r in runs) == sorted(AGENTS)
    for r in runs:
        a = r.data.tags["hacrl.agent"]
        assert "mlflow.parentRunId" not in r.data.tags  # top level: every chart shows it
        hist = c.get_metric_history(r.info.run_id, "eval/accuracy")
        assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == [(t, x[a]) for t, x in enumerate(accs)]
        assert [m.step for m in c.get_metric_history(r.info.run_id, "train/entropy")] == [1, 2]
        # per-update figures at the learner's update count, the undefined one left out
        loss = sorted((m.step, m.value) for m in c.get_metric_history(r.info.run_id, "train/per_update/loss"))
        assert loss == [(0, 0.5), (2, 0.25), (3, 0.125), (4, 0.5), (6, 0.25), (7, 0.125)]
        assert r.data.params["name"] == a and r.info.status == "FINISHED"
    # 1 experiment run + 3 iteration runs + 2 agent runs, whatever the number of stages
    assert len(c.search_runs([tr.experiment_id])) == 6


def test_mlflow_lists_held_out_accuracy_first(tracked):
    """Issue 28 (3): MLflow's chart view makes a section of each name's part before its last '/',
    lists the sections by name before the unprefixed ones ("Model metrics") and sorts charts by
    name in a section (its runs-charts.types.ts). Every figure logged here has a section, and
    the first section's first chart is the held-out accuracy."""
    from hacrl.ops.tracking import chart_key

    tr = tracked[3]
    c = tr.client
    keys = {k for r in c.search_runs([tr.experiment_id]) for k in r.data.metrics}
    assert "eval/accuracy" in keys and all("/" in k for k in keys), sorted(keys)
    sections = sorted({k.rsplit("/", 1)[0] for k in keys})
    assert sections[0] == "eval" and sorted(k for k in keys if k.startswith("eval/"))[0] == "eval/accuracy"
    # the names the stages give, whatever they are
    assert [chart_key(k) for k in ("eval_accuracy", "by_level/add", "train_update_loss", "train_entropy",
                                   "reward_mean", "verdict_timeout", "thl_from/a/straddle", "omega/a", "p_hat",
                                   "params", "wall_s/report", "warmup/steps", "rescued_now_accuracy")] == [
        "eval/accuracy", "eval/by_level/add", "train/per_update/loss", "train/entropy", "rollout/reward_mean",
        "rollout/verdict/timeout", "exchange/thl_from/a/straddle", "sharing/omega/a", "sharing/p_hat",
        "pool/params", "wall_s/report", "warmup/steps", "other/rescued_now_accuracy"]
    # any other name, a new figure's, lands in a section after eval
    assert all(chart_key(k).rsplit("/", 1)[0] > "eval" for k in ("zzz", "a_b", "aaa/b", "learner_cross", "train_x"))


def test_iteration_runs_nest_in_the_experiment_run_with_stage_times_and_inputs(tracked):
    tmp_path, cfg, lay, tr, accs = tracked
    c = tr.client
    doc = read_json(lay.runs / ".tracking" / "runs.json")
    exp = c.get_run(doc["experiment_run"])
    assert exp.data.params["algorithm.name"] == "grpo" and exp.data.tags["hacrl.kind"] == "experiment"
    it2 = c.get_run(doc["iterations"]["2"])
    assert it2.data.tags["mlflow.parentRunId"] == exp.info.run_id and it2.info.run_name == "it2"
    assert it2.data.metrics["wall_s/update-policies"] == 3.0
    assert it2.data.metrics["stage/verify-rewards/fast_path_verdicts"] == 7
    # the stages' own times: from the first stage's start to evaluate's end
    assert (it2.info.start_time, it2.info.end_time) == (3_000_000, 3_005_500)
    digests = {d.dataset.name: d.dataset.digest for d in it2.inputs.dataset_inputs}
    assert digests["rollouts/it2/gpt2-a"] == dvc_hash(lay.it(2) / "rollouts" / "gpt2-a.parquet")
    assert digests["heldout"] == dvc_hash(lay.tasks / "heldout.jsonl")
    # checkpoints in (iteration 1's) and out (iteration 2's) as logged models
    names = lambda ids: sorted(c.get_logged_model(i).name for i in ids)  # noqa: E731
    assert names([m.model_id for m in it2.outputs.model_outputs]) == ["gpt2-a-it2", "llama-b-it2"]
    # in: the checkpoints it started from, only (the ones it wrote and evaluated are outputs)
    assert names([m.model_id for m in it2.inputs.model_inputs]) == ["gpt2-a-it1", "llama-b-it1"]
    # its Parameters tab holds the config that ran; its datasets name project-relative paths
    assert it2.data.params["trainer.lr"] == str(cfg.trainer.lr)
    sources = [json.loads(d.dataset.source)["uri"] for d in it2.inputs.dataset_inputs]
    assert sources and all(not u.startswith("/") and "://" not in u for u in sources), sources


def test_every_checkpoint_is_a_logged_model_ranked_by_its_linked_heldout_accuracy(tracked):
    tmp_path, cfg, lay, tr, accs = tracked
    c = tr.client
    models = c.search_logged_models([tr.experiment_id], order_by=[{"field_name": "metrics.eval/accuracy",
                                                                   "ascending": False}])
    assert len(models) == 6  # 2 agents x iterations 0..2
    best = models[0]
    assert best.name == "gpt2-a-it2" and best.tags["hacrl.checkpoint"] == "runs/it2/checkpoints/gpt2-a"
    assert best.tags["hacrl.dvc_hash"] == dvc_hash(lay.checkpoint(2, "gpt2-a"))
    assert best.tags["mlflow.model.isExternal"] == "true" and best.params["algorithm.name"] == "grpo"
    (m,) = [m for m in best.metrics if m.key == "eval/accuracy"]
    assert (m.value, m.step, m.dataset_name) == (0.5, 2, "heldout")
    # a figure on other data (SGT's rescued training prompts) goes with the model, not the held-out set
    (r,) = [m for m in best.metrics if m.key == "other/rescued_now_accuracy"]
    assert r.dataset_name is None
    assert m.dataset_digest == dvc_hash(lay.tasks / "heldout.jsonl")
    # two clicks: the model's source run is its iteration, whose inputs are the shards it learnt from
    src = c.get_run(best.source_run_id)
    assert src.info.run_name == "it2"
    assert "rollouts/it2/gpt2-a" in {d.dataset.name for d in src.inputs.dataset_inputs}
    # registered versions, one alias per iteration
    rm = c.get_registered_model(tr.model_name("gpt2-a"))
    assert set(rm.aliases) == {"it0", "it1", "it2"}
    v = c.get_model_version_by_alias(tr.model_name("gpt2-a"), "it2")
    assert v.source == f"models:/{best.model_id}" and v.run_id == best.source_run_id
    assert v.tags["iteration"] == "2" and v.tags["dvc_hash"] == best.tags["hacrl.dvc_hash"]
    # the UI's model page: "registered" (it reads mlflow.modelVersions) and a description naming
    # the checkpoint, its DVC hash and the shards it was trained on
    import json

    assert json.loads(best.tags["mlflow.modelVersions"]) == [{"name": tr.model_name("gpt2-a"), "version": v.version}]
    note = best.tags["mlflow.note.content"]
    assert best.tags["hacrl.checkpoint"] in note and best.tags["hacrl.dvc_hash"] in note and "runs/it2/rollouts/" in note


def test_a_failed_stage_fails_its_iteration_run_with_the_stage_and_reason(tracked):
    tmp_path, cfg, lay, tr, accs = tracked
    tr.log_stage("generate-rollouts", 3, StageResult({}), 0.5, "RuntimeError: boom", start_ms=9_000_000,
                 end_ms=9_000_500)
    run = tr.client.get_run(read_json(lay.runs / ".tracking" / "runs.json")["iterations"]["3"])
    assert run.info.status == "FAILED" and run.data.tags["hacrl.failed_stage"] == "generate-rollouts"
    assert run.data.tags["hacrl.error"] == "RuntimeError: boom"
    # the rerun resumes the iteration's run; the failure stays on record
    tr.log_stage("generate-rollouts", 3, StageResult({}), 0.7, start_ms=9_100_000, end_ms=9_100_700)
    again = tr.client.get_run(run.info.run_id)
    assert again.info.status == "RUNNING" and "hacrl.error" not in again.data.tags
    assert again.data.tags["hacrl.failures"] == "1"
    assert again.data.tags["hacrl.last_failure"] == "generate-rollouts: RuntimeError: boom"
    walls = tr.client.get_metric_history(run.info.run_id, "wall_s/generate-rollouts")
    assert sorted(m.value for m in walls) == [0.5, 0.7]


def test_a_config_that_changes_results_starts_a_new_experiment_run(tracked):
    tmp_path, cfg, lay, tr, accs = tracked
    old = read_json(lay.runs / ".tracking" / "runs.json")
    # more iterations (the flow extends the experiment): the same runs go on
    tr.cfg = _cfg(tmp_path, "experiment.iterations=5")
    _iteration(tr, lay, 3, {"gpt2-a": 0.6, "llama-b": 0.5})
    same = read_json(lay.runs / ".tracking" / "runs.json")
    assert same["experiment_run"] == old["experiment_run"] and same["agents"] == old["agents"]
    # another learning rate: new experiment and agent runs, saying which run they supersede
    tr.cfg = _cfg(tmp_path, "trainer.lr=1e-4")
    _iteration(tr, lay, 1, {"gpt2-a": 0.2, "llama-b": 0.2}, salt="lr")
    new = read_json(lay.runs / ".tracking" / "runs.json")
    assert new["experiment_run"] != old["experiment_run"]
    assert tr.client.get_run(new["experiment_run"]).data.tags["hacrl.supersedes"] == old["experiment_run"]
    assert not set(new["agents"].values()) & set(old["agents"].values())
    # named apart from the runs they supersede, by what changed (the legend tells them apart)
    exp_name = tr.client.get_run(new["experiment_run"]).info.run_name
    assert exp_name == f"{cfg.experiment.name} #2 (trainer.lr=0.0001)", exp_name
    assert tr.client.get_run(new["agents"]["gpt2-a"]).info.run_name == "gpt2-a #2 · trainer.lr=0.0001"
    assert tr.client.get_run(old["agents"]["gpt2-a"]).info.run_name == "gpt2-a"



def test_credentials_in_a_uri_never_reach_mlflow_params():
    import dataclasses

    from hacrl.ops.tracking import flatten

    cfg = params.from_dict(params.compose(SMOKE))
    cfg.tracking.uri = "https://alice:s3cr3t@mlflow.example.org:5000"
    flat = flatten(dataclasses.asdict(cfg))
    assert flat["tracking.uri"] == "https://***@mlflow.example.org:5000"
    assert not any("s3cr3t" in v for v in flat.values())


def test_a_rerun_that_writes_the_identical_checkpoint_keeps_its_model(tracked):
    tmp_path, cfg, lay, tr, accs = tracked
    before = {m.model_id for m in tr.client.search_logged_models([tr.experiment_id])}
    versions = len(tr.client.search_model_versions(f"name = '{tr.model_name('gpt2-a')}'"))
    _iteration(tr, lay, 2, accs[2])  # the same files again (a forced rerun of a deterministic stage)
    assert {m.model_id for m in tr.client.search_logged_models([tr.experiment_id])} == before
    assert len(tr.client.search_model_versions(f"name = '{tr.model_name('gpt2-a')}'")) == versions


def test_a_stage_rerun_in_a_resumed_iteration_run_links_each_model_once(tracked):
    """`make run` after a code change reruns update-policies in the iteration runs it resumes:
    MLflow refuses a model link a run already holds (a unique key), which lost the record."""
    tmp_path, cfg, lay, tr, accs = tracked
    it2 = read_json(lay.runs / ".tracking" / "runs.json")["iterations"]["2"]
    for _ in range(2):
        tr.log_stage("update-policies", 2, StageResult({}, checkpoints={a: str(lay.checkpoint(2, a)) for a in AGENTS}),
                     1.0)
    run = tr.client.get_run(it2)
    ins = [m.model_id for m in run.inputs.model_inputs]
    outs = [m.model_id for m in run.outputs.model_outputs]
    assert len(ins) == len(set(ins)) == 2 and len(outs) == len(set(outs)) == 2


def test_a_parquet_shard_input_carries_its_record_schema_and_profile(tmp_path):
    """The dataset drawer of a rollout shard: the record schema and rows, not "No schema available"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hacrl.pipeline.result import Input

    cfg = _cfg(tmp_path)
    tr = Tracker(cfg, tmp_path)
    d = tmp_path / "runs" / "it1" / "rollouts"
    d.mkdir(parents=True)
    pq.write_table(pa.table({"record_id": ["a", "b"], "reward": [1.0, 0.0], "response_token_ids": [[1, 2], [3]]}),
                   d / "gpt2-a.parquet")
    ent = tr._dataset(Input("rollouts/it1", str(d), "training"))._to_mlflow_entity()
    assert json.loads(ent.source)["uri"] == "runs/it1/rollouts"
    cols = {c["name"]: c["type"] for c in json.loads(ent.schema)["mlflow_colspec"]}
    assert cols["record_id"] == "string" and cols["reward"] == "double" and any("response_token_ids" in k for k in cols)
    assert json.loads(ent.profile) == {"files": 1, "rows": 2, "bytes": (d / "gpt2-a.parquet").stat().st_size}
