"""MWRA: the planner on declared inventories (no device needed: the plan is declarative)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from hacrl.config import build
from hacrl.config import schema as config
from hacrl.errors import ConfigError
from hacrl.pipeline import params
from hacrl.resources import PlanError, plan

AGENTS = ["small", "mid", "large"]


def res(data: dict) -> config.ResourcesConfig:
    return build.build(config.ResourcesConfig, data, "resources")


def gpus(n: int, gib: float = 80) -> list[dict]:
    return [{"id": f"cuda:{i}", "memory_gib": gib} for i in range(n)]


def assert_sound(p, r: config.ResourcesConfig) -> None:
    """Every wave's jobs use disjoint devices that exist and hold their memory."""
    cap = {d.id: d.memory_gib for d in r.devices}
    for w in p.waves:
        used = [d for j in w.jobs for d in j.devices]
        assert len(used) == len(set(used)), w
        for j in w.jobs:
            assert all(d in cap and (cap[d] == 0 or j.memory_gib <= cap[d]) for d in j.devices), j


def test_the_default_cpu_host_runs_everything_in_turn():
    r = config.ResourcesConfig()
    p = plan(r, AGENTS)
    assert [(w.stage, [j.agent for j in w.jobs]) for w in p.waves] == [
        ("rollout", ["small"]), ("rollout", ["mid"]), ("rollout", ["large"]),
        ("update", ["small"]), ("update", ["mid"]), ("update", ["large"])]
    # the host's memory is not declared: an idle CPU engine costs no cores, so engines stay up
    # (an in-process run then syncs them in place instead of restarting them)
    assert p.releases == [] and p.kept_alive == AGENTS


def test_a_cpu_host_with_declared_memory_stops_engines_before_the_next_job():
    r = res({"devices": [{"id": "cpu", "memory_gib": 24}]})
    p = plan(r, AGENTS)
    assert [(x.before, x.agent, x.action) for x in p.releases] == [(1, "small", "stop"), (2, "mid", "stop"),
                                                                   (3, "large", "stop")]
    assert p.kept_alive == []


def test_eight_gpus_three_agents_of_different_sizes():
    r = res({"devices": gpus(8), "agents": {
        "small": {"rollout": {"devices": 1, "memory_gib": 10}, "update": {"devices": 1, "memory_gib": 30}},
        "mid": {"rollout": {"devices": 1, "memory_gib": 40}, "update": {"devices": 2, "memory_gib": 60}},
        "large": {"rollout": {"devices": 2, "memory_gib": 70}, "update": {"devices": 4, "memory_gib": 75}}}})
    p = plan(r, AGENTS)
    assert_sound(p, r)
    # 1 + 1 + 2 GPUs of rollouts at once, then 1 + 2 + 4 of updates at once
    assert [w.stage for w in p.waves] == ["rollout", "update"]
    assert {j.agent: len(j.devices) for j in p.jobs("rollout")} == {"small": 1, "mid": 1, "large": 2}
    assert {j.agent: len(j.devices) for j in p.jobs("update")} == {"small": 1, "mid": 2, "large": 4}
    # an update is colocated with its own engine (so it displaces no other agent's); an engine
    # sleeps exactly when an update needs one of its GPUs, the others stay up
    engines = {j.agent: set(j.devices) for j in p.jobs("rollout")}
    for a in AGENTS:
        assert engines[a] <= set(p.job(a, "update").devices)
        others = set().union(*(engines[b] for b in AGENTS if b != a))
        assert not set(p.job(a, "update").devices) & others
    busy = {d for j in p.jobs("update") for d in j.devices}
    assert {x.agent for x in p.releases} == {a for a, d in engines.items() if d & busy}
    assert all(x.before == 1 and x.action == "sleep" for x in p.releases)
    assert set(p.kept_alive) == set(AGENTS) - {x.agent for x in p.releases}
    assert plan(r, AGENTS).to_dict() == p.to_dict()  # deterministic


def test_jobs_that_share_a_device_run_in_turn_with_the_engine_released_first():
    r = res({"devices": gpus(2), "engine_release": "stop", "agents": {
        "small": {"rollout": {"pin": ["cuda:0"]}, "update": {"pin": ["cuda:0"]}},
        "mid": {"rollout": {"pin": ["cuda:0"]}, "update": {"pin": ["cuda:1"]}},
        "large": {"rollout": {"pin": ["cuda:1"]}, "update": {"devices": 2, "memory_gib": 50}}}})
    p = plan(r, AGENTS)
    assert_sound(p, r)
    stages = [(w.stage, sorted(j.agent for j in w.jobs)) for w in p.waves]
    # small and mid both want cuda:0: two rollout waves; large's 2-GPU update needs both GPUs
    assert stages[0] == ("rollout", ["large", "small"]) and stages[1] == ("rollout", ["mid"])
    assert ("update", ["large"]) in stages
    first = {(x.before, x.agent) for x in p.releases}
    assert (1, "small") in first  # small's engine leaves cuda:0 before mid's engine starts
    assert all(x.action == "stop" for x in p.releases)


def test_engines_alive_caps_the_engines_up_at_once():
    r = res({"devices": gpus(4), "engines_alive": 1})
    p = plan(r, AGENTS)
    assert [len(w.jobs) for w in p.waves if w.stage == "rollout"] == [1, 1, 1]
    alive = 0
    for i, w in enumerate(p.waves):
        alive -= sum(1 for x in p.releases if x.before == i)
        if w.stage == "rollout":
            alive += len(w.jobs)
            assert alive <= 1


@pytest.mark.parametrize("agents,needle", [
    ({"large": {"update": {"devices": 4, "memory_gib": 100}}},
     "resources.agents.large.update.memory_gib: agent large's update needs 4 device(s) with 100 GiB each"),
    ({"large": {"update": {"devices": 9}}}, "resources.agents.large.update.devices: agent large's update needs 9 devices"),
    ({"mid": {"rollout": {"pin": ["cuda:8"]}}}, "resources.agents.mid.rollout.pin: device 'cuda:8' is not in"),
    ({"mid": {"rollout": {"pin": ["cuda:0"], "memory_gib": 81}}}, "resources.agents.mid.rollout.memory_gib: agent mid's rollout needs 81 GiB per device; cuda:0 has 80 GiB"),
    ({"mid": {"rollout": {"pin": ["cuda:0", "cuda:1"], "devices": 3}}},
     "resources.agents.mid.rollout.devices: 3 but pin names 2 devices"),
    ({"nobody": {}}, "resources.agents.nobody: no such agent"),
])
def test_a_plan_that_cannot_fit_names_the_agent_and_the_resource(agents, needle):
    with pytest.raises(PlanError, match="^" + needle.replace("(", r"\(").replace(")", r"\)")):
        plan(res({"devices": gpus(8), "agents": agents}), AGENTS)


def test_the_config_refuses_an_impossible_plan_before_any_work(tmp_path):
    """``hacrl config`` composes and validates: the planner's error is one line, exit 2, nothing written."""
    out = tmp_path / "params.yaml"
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "config", "--out", str(out),
                        "resources.devices=[{id: 'cuda:0', memory_gib: 24}]",
                        "+resources.agents.qwen2-strong={update: {devices: 1, memory_gib: 40}}"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and not out.exists(), p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        "hacrl: error: resources.agents.qwen2-strong.update.memory_gib: agent qwen2-strong's update needs")
    ok = subprocess.run([sys.executable, "-m", "hacrl.cli", "resources",
                         "resources.devices=[{id: 'cuda:0', memory_gib: 80}, {id: 'cuda:1', memory_gib: 80}]"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "wave 0: rollout gpt2-weak on cuda:0; llama-mid on cuda:1" in ok.stdout, ok.stderr


def test_run_stage_runs_a_waves_jobs_at_once_and_the_waves_in_turn():
    import threading
    import time

    from hacrl.resources import device_env, job_threads, run_stage

    r = res({"devices": gpus(2), "engine_release": "sleep", "agents": {
        "large": {"rollout": {"devices": 2}, "update": {"devices": 2}}}})
    p = plan(r, AGENTS)
    spans, released, lock = {}, [], threading.Lock()

    def job(j):
        t0 = time.monotonic()
        time.sleep(0.3)
        with lock:
            spans[j.agent] = (t0, time.monotonic(), threading.current_thread().name)
        return device_env(j.devices)

    out = run_stage(p, "update", job, release=released.append)
    waves = [[j.agent for j in w.jobs] for w in p.waves if w.stage == "update"]
    assert waves == [["large"], ["small", "mid"]]
    assert out["large"] == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert {out["small"]["CUDA_VISIBLE_DEVICES"], out["mid"]["CUDA_VISIBLE_DEVICES"]} == {"0", "1"}
    a, b = spans["small"], spans["mid"]
    assert a[0] < b[1] and b[0] < a[1], "the jobs of one wave overlap in time"
    assert spans["large"][1] <= min(a[0], b[0]), "a wave starts when the one before has finished"
    # the engines still up are put to sleep before the first update wave, which needs both GPUs
    # (large's was released in the rollout stage, before small's and mid's took its GPUs)
    assert sorted(x.agent for x in released) == ["mid", "small"] and {x.action for x in released} == {"sleep"}
    assert [x.agent for x in p.releases if p.waves[x.before].stage == "rollout"] == ["large"]
    assert job_threads(r, p.job("small", "update"), 16) == 16  # GPUs: the host's threads
    cpu = res({"devices": [{"id": "cpu:0"}, {"id": "cpu:1"}]})
    assert job_threads(cpu, plan(cpu, AGENTS).job("small", "update"), 2) == 1


def test_a_failed_job_fails_the_stage_naming_the_agent_after_its_wave_finishes():
    import time

    from hacrl.resources import run_stage

    p = plan(res({"devices": gpus(3)}), AGENTS)
    finished = []

    def job(j):
        if j.agent == "mid":
            raise RuntimeError("out of memory")
        time.sleep(0.2)
        finished.append(j.agent)

    with pytest.raises(RuntimeError, match="out of memory") as e:  # the job's own exception
        run_stage(p, "update", job)
    assert re.fullmatch(r"update of mid \(wave \d, on cuda:\d\)", e.value.__notes__[0])
    assert sorted(finished) == ["large", "small"]


def test_cpu_shares_and_the_whole_host_do_not_mix():
    with pytest.raises(ConfigError, match="not both"):
        params.from_dict({**params.compose([]), "resources": {"devices": [{"id": "cpu"}, {"id": "cpu:0"}]}})


def test_stage_devices_tags_and_gpu_routing_follow_the_plan():
    from hacrl.ops.orchestration import device_tags, gpu_stages, stage_devices

    cpu = params.from_dict(params.compose([]))
    assert stage_devices(cpu, "update-policies@it3") == ("cpu",) and device_tags(("cpu",)) == []
    assert stage_devices(cpu, "verify-rewards") == ()
    assert gpu_stages(cpu) == ("update-policies",)  # the routing as before on a CPU host
    g = params.from_dict(params.compose(["resources.devices=[{id: 'cuda:0', memory_gib: 80}, {id: 'cuda:1', memory_gib: 80}]"]))
    assert stage_devices(g, "generate-rollouts") == ("cuda:0", "cuda:1")
    assert device_tags(stage_devices(g, "evaluate")) == ["device:cuda:0", "device:cuda:1"]
    assert gpu_stages(g) == ("evaluate-warmup", "generate-rollouts", "update-policies", "evaluate")


def test_device_env_translates_through_the_stage_process_view_and_hides_gpus_from_cpu_jobs(monkeypatch):
    from hacrl.resources import device_env, job_cores

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_env(("cuda:1", "cuda:3")) == {"CUDA_VISIBLE_DEVICES": "1,3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a GPU worker given 4 of 8 GPUs
    assert device_env(("cuda:1", "cuda:3")) == {"CUDA_VISIBLE_DEVICES": "5,7"}
    assert device_env(("cpu",)) == {"CUDA_VISIBLE_DEVICES": ""}
    cpu = res({"devices": [{"id": "cpu:0"}, {"id": "cpu:1"}]})
    p = plan(cpu, AGENTS)
    cores = {j.agent: job_cores(cpu, j, 8) for j in p.waves[0].jobs}
    assert sorted(cores.values()) == [(0, 4), (4, 4)]  # disjoint cores for the jobs of one wave
    assert job_cores(res({"devices": gpus(1)}), plan(res({"devices": gpus(1)}), AGENTS).waves[0].jobs[0], 8) is None
