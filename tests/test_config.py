import subprocess
import sys

import pytest
import yaml

from hacrl import config


def test_params_yaml_is_the_composition_of_conf(root):
    committed = yaml.safe_load((root / "params.yaml").read_text())
    assert committed == config.compose([]), "params.yaml is stale: run `hacrl config`"


def test_iterations_table_has_explicit_prev():
    assert config.iteration_table(3) == {"it1": {"it": 1, "prev": 0}, "it2": {"it": 2, "prev": 1},
                                         "it3": {"it": 3, "prev": 2}}


def test_overrides_reach_the_typed_config():
    data = config.compose(["algorithm=gspo", "rollout.group_size=4", "experiment.iterations=3"])
    cfg = config.from_dict(data)
    assert cfg.algorithm.name == "gspo" and cfg.algorithm.loss.name == "gspo"
    assert (cfg.algorithm.loss.clip_low, cfg.algorithm.loss.clip_high) == (3e-4, 4e-4)  # the registered defaults
    assert cfg.rollout.group_size == 4 and list(data["iterations"]) == ["it1", "it2", "it3"]
    assert len(cfg.agents) == 3 and len({a.arch for a in cfg.agents}) == 3


@pytest.mark.parametrize("override, key, value", [
    ("algorithm=foo", "algorithm", "foo"),
    ("algorithm.loss.name=foo", "algorithm.loss.name", "foo"),
    ("+algorithm.loss.alhpa=3", "algorithm.loss.alhpa", "3"),
    ("algorithm.loss.clip_low=-1", "algorithm.loss.clip_low", "-1"),
    ("algorithm.subscription.0.record_type=rollout", "algorithm.subscription[0].record_type", "rollout"),
    ("rollout.group_size=1", "rollout.group_size", "1"),
    ("agents.pool.0.path=/no/such/model", "agents[0].path", "/no/such/model"),
    ("agents.pool.1.tokenizer.kind=sentencepiece", "agents[1].tokenizer.kind", "sentencepiece"),
    ("trainer.zero_stage=7", "trainer.zero_stage", "7"),
    ("+rollout.bogus=1", "rollout.bogus", "1"),
    ("rollout.engine=sglang", "rollout.engine", "sglang"),
    ("engines.vllm_kv_cache_gib=0", "engines.vllm_kv_cache_gib", "0"),
    ("engines.vllm_gpu_memory_utilization=1.5", "engines.vllm_gpu_memory_utilization", "1.5"),
    ("+agents.pool.0.fetch=llama70b", "agents[0].fetch", "llama70b"),
])
def test_bad_config_fails_at_start_with_one_line(tmp_path, override, key, value):
    out = tmp_path / "params.yaml"
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "config", override, "--out", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert key in lines[0] and value in lines[0]
    assert not out.exists(), "a rejected config must not be written"


def test_stage_rejects_a_hand_edited_bad_params_file(tmp_path):
    data = config.compose([])
    data["algorithm"]["loss"]["name"] = "ppo-typo"
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(data))
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", "prepare-data", "--params", str(bad)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("hacrl: error: algorithm.loss.name: invalid value 'ppo-typo'")


def test_malformed_dataset_stops_prepare_data_with_file_and_line(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"}\n')
    held = tmp_path / "held.jsonl"
    held.write_text('{"problem": "3+3?", "answer": "6"}\n')
    params = tmp_path / "params.yaml"
    config.write_params(config.compose(["data=files", f"data.train_path={train}",
                                        f"data.heldout_path={held}"]), params)
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", "prepare-data", "--params", str(params)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == f"hacrl: error: {train}:2: missing field 'answer'"
    assert not (tmp_path / "data" / "tasks").exists()


def test_a_fetched_agent_needs_no_model_directory_yet():
    cfg = config.from_dict(config.compose(["agents=smollm2_mix", "experiment=smollm2"]))
    smol = cfg.agents[0]
    assert smol.fetch == "smollm2" and smol.chat and smol.path == "models/SmolLM2-135M-Instruct"
    assert cfg.data.heldout_size == 64 and cfg.rollout.max_new_tokens == 48  # the experiment file wins
    assert cfg.rollout.engine == "hf"
    v = config.from_dict(config.compose(["agents=smollm2_mix", "experiment=smollm2", "rollout=vllm"]))
    assert v.rollout.engine == "vllm" and v.rollout.max_new_tokens == 48
