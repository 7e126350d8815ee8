import os
import subprocess
import sys

import pytest
import yaml

from hacrl.errors import ConfigError
from hacrl.pipeline import params

from conftest import ROOT


def test_params_yaml_is_the_composition_of_conf(root):
    committed = yaml.safe_load((root / "params.yaml").read_text())
    generated = yaml.safe_load((root / "dvc.vars.yaml").read_text())
    # the settings in params.yaml, the keys dvc.yaml's templating needs apart (dvc params diff
    # params.yaml and dvc exp show list settings only)
    assert not set(params.GENERATED_KEYS) & set(committed) and set(generated) == set(params.GENERATED_KEYS)
    assert {**committed, **generated} == params.compose([]), "params.yaml is stale: run `hacrl config`"


def test_iterations_table_has_explicit_prev():
    assert params.iteration_table(3) == {"it1": {"it": 1, "prev": 0}, "it2": {"it": 2, "prev": 1},
                                         "it3": {"it": 3, "prev": 2}}


def test_overrides_reach_the_typed_config():
    data = params.compose(["algorithm=gspo", "rollout.group_size=4", "experiment.iterations=3"])
    cfg = params.from_dict(data)
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
    ("engines.vllm.kv_cache_gib=0", "engines.vllm.kv_cache_gib", "0"),
    ("engines.vllm.gpu_memory_utilization=1.5", "engines.vllm.gpu_memory_utilization", "1.5"),
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
    data = params.compose([])
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
    pfile = tmp_path / "params.yaml"
    params.write_params(params.compose(["data=files", f"data.train_path={train}",
                                        f"data.heldout_path={held}"]), pfile)
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", "prepare-data", "--params", str(pfile)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == f"hacrl: error: {train}:2: missing field 'answer' (data.fields.answer)"
    assert not (tmp_path / "data" / "tasks").exists()


def test_a_fetched_agent_needs_no_model_directory_yet():
    cfg = params.from_dict(params.compose(["agents=smollm2_mix", "experiment=smollm2"]))
    smol = cfg.agents[0]
    assert smol.fetch == "smollm2" and smol.chat and smol.path == "models/SmolLM2-135M-Instruct"
    assert cfg.data.heldout_size == 64 and cfg.rollout.max_new_tokens == 48  # the experiment file wins
    assert cfg.rollout.engine == "hf"
    v = params.from_dict(params.compose(["agents=smollm2_mix", "experiment=smollm2", "rollout=vllm"]))
    assert v.rollout.engine == "vllm" and v.rollout.max_new_tokens == 48


def test_recomposing_keeps_an_experiment_the_flow_extended(tmp_path):
    """`make run` after Prefect grew the experiment to 7 iterations keeps 7 (and says so); an
    explicit experiment.iterations, or another experiment, takes the composition's count."""
    import yaml

    from hacrl.cli import main
    from hacrl.ops.orchestration import extend_to

    out = tmp_path / "params.yaml"
    assert main(["config", "--out", str(out)]) == 0
    n = yaml.safe_load(out.read_text())["experiment"]["iterations"]
    extend_to(tmp_path, n + 1)  # what the flow does once every configured iteration is done
    assert main(["config", "--out", str(out)]) == 0
    data = params.read_params(tmp_path)  # with dvc.vars.yaml's iteration table
    assert data["experiment"]["iterations"] == n + 1 and f"it{n + 1}" in data["iterations"]
    assert main(["config", "--out", str(out), "--check"]) == 0
    assert main(["config", "--out", str(out), "experiment.iterations=2"]) == 0
    assert yaml.safe_load(out.read_text())["experiment"]["iterations"] == 2
    extend_to(tmp_path, 9)
    assert main(["config", "--out", str(out), "experiment=smoke"]) == 0  # another experiment
    assert yaml.safe_load(out.read_text())["experiment"]["iterations"] != 9


def test_one_agents_setting_by_name_or_position():
    from hacrl.errors import ConfigError
    from hacrl.pipeline.params import compose

    base = {a["name"]: a for a in compose([])["agents"]}
    by_name = {a["name"]: a for a in compose(["agents.gpt2-weak.warmup.lr=1e-3"])["agents"]}
    assert by_name["gpt2-weak"]["warmup"]["lr"] == 1e-3
    assert by_name["llama-mid"] == base["llama-mid"] and by_name["qwen2-strong"] == base["qwen2-strong"]
    by_pos = compose(["agents.2.warmup.max_steps=7", "agents.pool.0.warmup.max_steps=5"])["agents"]
    assert [a["warmup"]["max_steps"] for a in by_pos] == [5, base["llama-mid"]["warmup"]["max_steps"], 7]
    # the names of the pool the other overrides choose
    mix = compose(["agents=smollm2_mix", "agents.qwen2-embedded.template='Q: {problem}'"])["agents"]
    assert mix[1]["template"] == "Q: {problem}"
    with pytest.raises(ConfigError, match=r"agents\.nope\.warmup\.lr: no agent 'nope' in the pool \(names: gpt2-weak"):
        compose(["agents.nope.warmup.lr=1"])


def test_cli_says_its_version_and_lists_the_stages():
    import subprocess
    import sys

    from hacrl import __version__
    from hacrl.pipeline import table

    STAGE_NAMES = table.names()
    env = {**__import__("os").environ, "HACRL_STAGE_SERVER": "0"}
    v = subprocess.run([sys.executable, "-m", "hacrl.cli", "--version"], capture_output=True, text=True, env=env)
    assert v.returncode == 0 and v.stdout.strip() == f"hacrl {__version__}"
    h = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", "--help"], capture_output=True, text=True, env=env)
    assert h.returncode == 0 and all(s in "".join(h.stdout.split()) for s in STAGE_NAMES)  # wrapped at hyphens


TYPE_ERRORS = [  # override -> the one line it gets
    ("trainer.lr=abc", "trainer.lr: invalid value 'abc' (expected a finite number)"),
    ("rollout.temperature='1.0'", "rollout.temperature: invalid value '1.0' (expected a finite number)"),
    ("data.levels=add", "data.levels: invalid value 'add' (expected a mapping to finite numbers)"),
    ("trainer.adam_betas=0.9", "trainer.adam_betas: invalid value 0.9 (expected a list of finite numbers)"),
    ("trainer.adam_betas=[0.9,1.5]", "trainer.adam_betas: invalid value [0.9, 1.5] (two numbers in [0, 1))"),
    ("tracking.enabled='false'", "tracking.enabled: invalid value 'false' (expected true or false)"),
    ("trainer.epochs=1.5", "trainer.epochs: invalid value 1.5 (expected an integer)"),
    ("reward.timeout_s=-1", "reward.timeout_s: invalid value -1.0 (must be > 0"),
    ("reward.timeout_s=0", "reward.timeout_s: invalid value 0.0 (must be > 0"),
    ("reward.workers=0", "reward.workers: invalid value 0 (must be >= 1"),
    ("experiment.iterations=0", "experiment.iterations: invalid value 0 (must be >= 1"),
    ("data.heldout_fraction=1", "data.heldout_fraction: invalid value 1.0 (must be > 0 and < 1)"),
    ("agents.0.warmup.lr=-1", "agents[0].warmup.lr: invalid value -1.0 (must be > 0"),
    ("experiment.name=\"x' or name != '\"", "experiment.name: invalid value \"x' or name != '\" (letters, digits,"),
    ("algoritm=gspo", "algoritm: unknown key (did you mean 'algorithm'? the config has: experiment, data, "
                      "agents, algorithm, rollout, trainer, reward, eval, engines, orchestration, tracking, resources)"),
    ("trainer.lrr=1", "trainer.lrr: unknown key (did you mean 'trainer.lr'? trainer has: backend, zero_stage, lr,"),
    # non-finite numbers pass no range check: refused as a class, whatever the field
    ("reward.timeout_s=inf", "reward.timeout_s: invalid value inf (expected a finite number)"),
    ("rollout.temperature=inf", "rollout.temperature: invalid value inf (expected a finite number)"),
    ("trainer.lr=nan", "trainer.lr: invalid value nan (expected a finite number)"),
    ("data.levels.add=inf", "data.levels: invalid value {"),
    ("trainer.adam_betas=[0.9,inf]", "trainer.adam_betas: invalid value [0.9, inf] (expected a list of finite numbers)"),
    ("agents.0.warmup.lr=inf", "agents[0].warmup.lr: invalid value inf (expected a finite number)"),
    ("algorithm=hacpo|algorithm.loss.alpha=inf", "algorithm.loss.alpha: invalid value inf (expected a finite number)"),
    # upper bounds: what no machine or model context allows, or what only a typo gives
    ("reward.timeout_s=1e10", "reward.timeout_s: invalid value 10000000000.0 (must be > 0 and <= 3600)"),
    ("rollout.group_size=1000000", "rollout.group_size: invalid value 1000000 (must be >= 2 and <= 4096"),
    ("reward.workers=1000", "reward.workers: invalid value 1000 (must be >= 1 and <= 64"),
    ("trainer.lr=3", "trainer.lr: invalid value 3.0 (must be > 0 and <= 1)"),
    ("experiment.seed=4294967296", "experiment.seed: invalid value 4294967296 (must be >= 0 and <= 4294967295)"),
    ("rollout.prompts_per_iteration=2000000", "rollout.prompts_per_iteration: invalid value 2000000 (2000000 prompts x 8 "
                                               "samples x 3 agents = 48,000,000 samples per iteration, held in memory"),
    # a label that names a preset must run it
    ("algorithm.name=gspo", "algorithm.name: invalid value 'gspo' (the gspo preset runs loss gspo, this config loss grpo"),
    ("algorithm=hacpo|algorithm.name=grpo", "algorithm.name: invalid value 'grpo' (the grpo preset runs advantage grpo, loss grpo"),
]


@pytest.mark.parametrize("override,message", TYPE_ERRORS)
def test_a_bad_value_is_one_line_naming_key_value_and_expected_type(override, message):
    with pytest.raises(ConfigError) as e:
        params.compose(override.split("|"))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_hand_edited_params_file_reads_as_hydra_and_dvc_read_it(tmp_path):
    text = (ROOT / "params.yaml").read_text()
    assert "  lr: 0.0005\n" in text and "  temperature: 1.0\n" in text
    (tmp_path / "a.yaml").write_text(text.replace("  lr: 0.0005\n", "  lr: 5e-4\n"))
    assert params.load(tmp_path / "a.yaml").trainer.lr == 0.0005  # YAML 1.2: a number, as for DVC
    (tmp_path / "b.yaml").write_text(text.replace("  temperature: 1.0\n", "  temperature: '1.0'\n"))
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", "prepare-data", "--params", str(tmp_path / "b.yaml")],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HACRL_STAGE_SERVER": "0"})
    assert p.returncode == 2 and p.stderr.strip() == \
        "hacrl: error: rollout.temperature: invalid value '1.0' (expected a finite number)"
    assert not (tmp_path / "data").exists()  # refused before any work
    (tmp_path / "c.yaml").write_text("experiment: [\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: not valid YAML"):
        params.load(tmp_path / "c.yaml")
    # a YAML alias bomb is refused at the first alias, before it expands
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(20))
    (tmp_path / "d.yaml").write_text(bomb + text)
    with pytest.raises(ConfigError, match=r"d\.yaml:2: not valid YAML \(an alias \(\*a\): YAML aliases are not accepted\)"):
        params.load(tmp_path / "d.yaml")


def test_the_label_of_a_variant_is_its_own_and_every_compare_contender_composes():
    """A renamed variant (GSPO x n, an ablation under the preset's name) is accepted: only a label
    naming another preset than what runs is refused."""
    cfg = params.from_dict(params.compose(["algorithm=gspo_x2", "algorithm.sample_multiplier=3", "algorithm.name=gspo_x3",
                                                 "algorithm.minibatch_order=prompt_groups"]))
    assert cfg.algorithm.name == "gspo_x3"
    assert params.from_dict(params.compose(["algorithm=hacpo", "algorithm.loss.cross_weight=0"])).algorithm.name == "hacpo"


def test_an_agent_path_that_is_not_a_model_is_refused_at_config_time(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(ConfigError) as e:
        params.compose([f"agents.pool.0.path={empty}"])
    assert str(e.value) == f"agents[0].path: invalid value '{empty}' (no config.json: not a Hugging Face model directory)"
    (empty / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        params.compose([f"agents.pool.0.path={empty}"])
    assert str(e.value).startswith(f"agents[0].path: invalid value '{empty}' (no tokenizer files (tokenizer.json,")
    (empty / "tokenizer.json").write_text("{}")
    assert params.compose([f"agents.pool.0.path={empty}"])["agents"][0]["path"] == str(empty)


def test_iterations_that_cannot_run_are_refused_before_anything_is_written(tmp_path):
    pfile = tmp_path / "params.yaml"
    from conftest import SMOKE

    data = params.compose([*SMOKE, "experiment.iterations=2", "tracking.enabled=false"])
    params.write_params(data, pfile)
    env = {**os.environ, "HACRL_STAGE_SERVER": "0"}
    for args, msg in ((["evaluate", "--iteration", "-1"], "--iteration: invalid value -1 (iterations 0-2 are configured"),
                      (["generate-rollouts", "--iteration", "5"], "--iteration: invalid value 5 (iterations 0-2"),
                      (["update-policies", "--iteration", "0"], "--iteration: invalid value 0 (RL iterations start at 1)")):
        p = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", *args, "--params", str(pfile)],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
        assert p.returncode == 2 and p.stderr.strip().startswith(f"hacrl: error: {msg}"), p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["dvc.vars.yaml", "params.yaml"]  # no runs/itN/, no MLflow store
    # a hand-edited count that disagrees with the iteration table dvc.yaml runs
    params.write_params({**data, "experiment": {**data["experiment"], "iterations": 5}}, pfile)
    with pytest.raises(ConfigError, match=r"experiment.iterations: invalid value 5 \(the iteration table "
                                                 r"dvc.yaml runs has 2 entries"):
        params.load(pfile)


def test_params_yaml_reads_back_what_was_written(tmp_path):
    """Strings YAML 1.2 would read as numbers (`2e4`, a commit id like `7e69083`) are quoted."""
    data = params.compose(["experiment.name='2e4'", "algorithm.name='7e69083'"])
    params.write_params(data, tmp_path / "params.yaml")
    assert "name: '2e4'" in (tmp_path / "params.yaml").read_text()
    cfg = params.load(tmp_path / "params.yaml")
    assert (cfg.experiment.name, cfg.algorithm.name) == ("2e4", "7e69083")


def test_composing_and_checking_a_config_imports_neither_torch_nor_mlflow():
    """``hacrl config`` and every stage's start-up check stay fast: the schema, the builder and the
    checks read the registries and tables of the modules they check, never their heavy imports."""
    code = ("import sys\nfrom hacrl.pipeline import params\n"
            "params.from_dict(params.compose(['algorithm=hacpo', 'rollout=vllm']))\n"
            "print(' '.join(m for m in ('torch', 'mlflow', 'transformers', 'deepspeed', 'vllm') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == "", f"imported: {p.stdout.strip()}"


def test_a_default_lives_in_the_schema_only():
    """conf/ presets state what they change: no preset repeats a schema default (the drift of
    rollout.max_new_tokens, 16 in the dataclass and 20 in conf/, cannot come back)."""
    import dataclasses

    from hacrl.config.schema import Config

    defaults = params.defaults()
    repeated = []
    for group in ("data", "rollout", "trainer", "experiment"):
        for f in sorted((params.CONF_DIR / group).glob("*.yaml")):
            doc = yaml.safe_load(f.read_text()) or {}
            sections = doc if "# @package _global_" in f.read_text() else {group: doc}
            for sec, body in sections.items():
                if sec == "defaults":  # Hydra's defaults list (a preset's own choice of other presets)
                    continue
                for k, v in (body or {}).items():
                    if k in ("source", "engine", "backend", "name"):  # what names the preset
                        continue
                    if defaults.get(sec, {}).get(k) == v:
                        repeated.append(f"{f.relative_to(params.CONF_DIR)}: {sec}.{k}={v!r}")
    assert not repeated, repeated
    # algorithm presets: what an algorithm is (its name, estimator, loss, subscription) plus what
    # differs from the defaults of AlgorithmConfig and of its registered options
    from hacrl.config.schema import AlgorithmConfig
    from hacrl.rl.algorithms import ADVANTAGES, LOSSES

    alg_defaults = dataclasses.asdict(AlgorithmConfig())
    for f in sorted((params.CONF_DIR / "algorithm").glob("*.yaml")):
        doc = yaml.safe_load(f.read_text())
        for k, v in doc.items():
            if k in ("advantage", "loss"):
                opts = dataclasses.asdict((ADVANTAGES if k == "advantage" else LOSSES)[v["name"]].options())
                repeated += [f"{f.name}: {k}.{o}={x!r}" for o, x in v.items() if o != "name" and opts.get(o) == x]
            elif k == "thl" or k == "capability":
                repeated += [f"{f.name}: {k}.{o}={x!r}" for o, x in v.items() if alg_defaults[k].get(o) == x]
            elif k not in ("name", "subscription") and alg_defaults.get(k) == v:
                repeated.append(f"{f.name}: {k}={v!r}")
    assert not repeated, repeated
    root = yaml.safe_load((params.CONF_DIR / "config.yaml").read_text())
    assert set(root) == {"defaults"}, "conf/config.yaml holds the defaults list only"
    assert dataclasses.asdict(Config())["rollout"]["max_new_tokens"] == params.compose([])["rollout"]["max_new_tokens"]


def test_the_settings_reference_is_the_schema():
    """docs/CONFIG.md is what `hacrl config --doc` writes from the schema: every setting with its
    default, type and rule (run `hacrl config --doc > docs/CONFIG.md` after changing one)."""
    from hacrl.config.doc import reference

    assert (ROOT / "docs" / "CONFIG.md").read_text() == reference() + "\n"
    text = reference()
    assert "| `rollout.max_new_tokens` | int | `20` | >= 1, <= 1048576 |" in text
    assert "| `trainer.dtype` | str | `\"fp32\"` | one of `fp32`, `bf16` |" in text


def test_a_task_path_of_the_wrong_kind_is_one_line(tmp_path):
    """A directory where a file is read (or the reverse) is refused at config time, not a traceback
    inside prepare-data."""
    d = tmp_path / "dir"
    d.mkdir()
    f = tmp_path / "t.jsonl"
    f.write_text('{"problem": "1+1", "answer": "2"}\n')
    for fmt, train, why in [("auto", d, "a directory that datasets.save_to_disk did not write"),
                            ("jsonl", d, "a directory, not a jsonl file"),
                            ("hf_disk", f, "a file: data=hf_disk reads")]:
        with pytest.raises(ConfigError) as e:
            params.compose(["data=files", f"data.train_path={train}", f"data.heldout_path={f}", f"data.format={fmt}"])
        assert str(e.value).startswith(f"data.train_path: invalid value '{train}' ({why}"), str(e.value)


def test_unclear_config_failures_say_what_to_do(tmp_path):
    """An empty params.yaml, a runs_dir dvc.yaml cannot follow, an unquoted non-ASCII value: each
    one line that says what is wrong and what to do."""
    (tmp_path / "params.yaml").write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"params\.yaml: empty \(run `hacrl config`"):
        params.load(tmp_path / "params.yaml")
    with pytest.raises(ConfigError, match=r"^data\.fields\.problem=énoncé: Hydra cannot read this override unquoted"):
        params.compose(["data.fields.problem=énoncé"])
    assert params.compose(["data.fields.problem='énoncé'"])["data"]["fields"]["problem"] == "énoncé"
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    env = {**os.environ, "HACRL_STAGE_SERVER": "0"}
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "config", "experiment.runs_dir=elsewhere", "--out",
                        str(tmp_path / "params.yaml")], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "experiment.runs_dir: invalid value 'elsewhere' (dvc.yaml reads and writes runs/" in p.stderr
    assert (tmp_path / "params.yaml").read_text() == "# nothing\n"  # nothing written
