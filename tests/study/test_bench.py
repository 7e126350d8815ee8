"""Every ``hacrl bench`` suite end to end at smoke size, through the CLI: the JSON and markdown
are written, every contender did the same work with a positive rate, and each goal is
evaluated. (The figures of a smoke run say nothing about speed; ``make bench`` measures.)"""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


# every suite of `make bench` (`hacrl bench all` at full size), at smoke size:
# README: make bench
# README: hacrl bench SUITE
def _bench(suite, out, *extra):
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "--log-level", "WARNING", "bench", suite,
                        "--size", "smoke", "--reps", "1", "--out", str(out), *extra],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / f"{suite}.json").read_text())
    assert (out / f"{suite}.md").read_text().startswith(f"## {suite}")
    assert res["suite"] == suite and res["size"] == "smoke" and res["reps"] == 1
    assert res["machine"]["cores"] >= 1
    for name, c in res["contenders"].items():
        assert c["units_per_s"] > 0 and c["peak_rss_mib"] > 0 and len(c["seconds"]) == 1, name
    for g in res["goals"]:
        assert isinstance(g["met"], bool) and g["contender"] in res["contenders"]
    return res


def test_rollout_suite_generates_the_same_tokens_both_ways(tmp_path):
    res = _bench("rollout", tmp_path)
    assert res["work"]["same_tokens"] is True
    assert res["contenders"]["stage"]["units"] == res["contenders"]["bare_generate"]["units"] > 0


def test_rollout_suite_on_smollm2_with_vllm_where_installed(tmp_path):
    import os

    from hacrl.rollout.vllm_engine import vllm_python

    res = _bench("rollout_smollm2", tmp_path)
    c = res["contenders"]
    assert res["work"]["same_tokens"] is True and res["work"]["agent"].startswith("smollm2-135m")
    assert c["stage"]["units"] == c["bare_generate"]["units"] > 0
    if vllm_python(".venv-vllm/bin/python").exists():
        assert c["stage_vllm"]["units"] > 0 and c["stage_vllm"]["extra"]["engine_startup_s"] > 0
    elif os.environ.get("HACRL_REQUIRE_VLLM") == "1":
        pytest.fail("HACRL_REQUIRE_VLLM=1 but there is no vLLM environment (make setup-vllm)")
    else:
        assert "stage_vllm" not in c


def test_update_suite_compares_the_stage_with_trl(tmp_path):
    res = _bench("update", tmp_path)
    c = res["contenders"]
    assert c["stage"]["units"] == c["stage_gen_logprobs"]["units"]
    # the flag's effect is visible: no no-grad pass with generation log-probs kept
    assert c["stage_gen_logprobs"]["extra"]["old_logprobs_recomputed"] == 0
    assert c["stage"]["extra"]["old_logprobs_recomputed"] > 0
    if "trl" in c:  # make setup-bench (CI installs it)
        assert res["work"]["trl"] == "1.16.0" and c["trl"]["extra"]["updates"] == res["work"]["mini_batches"]


def test_evaluate_suite(tmp_path):
    res = _bench("evaluate", tmp_path)
    n = res["work"]["heldout"] * len(res["work"]["agents"].split(", "))
    c = res["contenders"]
    assert c["stage"]["units"] == c["stage_hosted"]["units"] == c["bare_generate"]["units"] == n
    # the same answers whether the verifier workers are the stage's own or the engine host's
    assert c["stage_hosted"]["extra"]["accuracy"] == c["stage"]["extra"]["accuracy"]


def test_align_suite_covers_every_pair_of_different_tokenizers(tmp_path):
    res = _bench("align", tmp_path)
    assert res["work"]["pairs"] == 2  # the tiny pool: two agents, two tokenizers
    assert set(res["contenders"]["retokenize_and_align"]["extra"]["records_per_s_by_pair"]) == \
        {"gpt2-a->llama-b", "llama-b->gpt2-a"}


def test_pipeline_suite_runs_direct_dvc_and_prefect(tmp_path):
    res = _bench("pipeline", tmp_path)
    assert set(res["contenders"]) == {"direct", "dvc", "prefect", "stage_process"}
    assert {(g["contender"], g["kind"]) for g in res["goals"]} == \
        {("dvc", "added_s"), ("prefect", "added_s"), ("stage_process", "max_s")}


def test_unknown_suite_is_one_line():
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "bench", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "unknown suite 'nope'" in p.stderr and "Traceback" not in p.stderr


def test_memory_suite_measures_each_cell_in_its_own_process(tmp_path):
    res = _bench("memory", tmp_path)
    m = res["contenders"]
    assert set(m) == {"whole-8x16", "budget-8x16", "budget-32x16", "budget-8x40", "budget-32x40"}
    assert all(c["peak_rss_mib"] > 0 and "above_model_and_optimizer_mib" in c["extra"] for c in m.values())
    # the budget cut the mini-batches (16-40 token responses, 128 padded tokens per forward)
    assert m["budget-32x40"]["extra"]["micro_batches"] > m["budget-8x40"]["extra"]["micro_batches"] > 1
    assert m["whole-8x16"]["extra"]["micro_batches"] == 1
    assert {g["kind"] for g in res["goals"]} == {"max_mib", "growth", "ratio"}


def test_memory_generate_suite_bounds_the_kv_cache_per_call(tmp_path):
    res = _bench("memory_generate", tmp_path)
    m = res["contenders"]
    assert set(m) == {"greedy-whole", "greedy-budget", "sampled-whole", "sampled-budget"}
    assert m["greedy-whole"]["extra"]["calls"] == 1 and m["greedy-budget"]["extra"]["calls"] > 1
    assert m["greedy-budget"]["units"] == m["greedy-whole"]["units"]  # the same greedy tokens, fewer at a time


def test_update_smollm2_suite_trains_on_512_token_style_responses_against_trl(tmp_path):
    res = _bench("update_smollm2", tmp_path)
    c = res["contenders"]
    assert res["work"]["samples_per_forward"] == 4 and res["work"]["response_tokens"] == 16  # smoke: 16, full: 512
    assert c["stage"]["units"] == res["work"]["samples"] > 0
    if "trl" in c:  # make setup-bench (CI installs it)
        assert c["trl"]["units"] == c["stage"]["units"] and c["trl"]["extra"]["updates"] == c["stage"]["extra"]["updates"]
        assert {g["kind"] for g in res["goals"]} == {"ratio", "growth"}


def test_pretrained_iteration_suite_runs_the_landed_code_beside_todays(tmp_path):
    from hacrl.study.bench.pretrained_iteration import BASE_REV

    have = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BASE_REV}^{{commit}}"], capture_output=True)
    if have.returncode != 0:
        pytest.skip(f"revision {BASE_REV} is not in this clone (a shallow one)")
    res = _bench("pretrained_iteration", tmp_path)
    c = res["contenders"]
    assert set(c) == {"landed", "defaults", "fast"} and res["work"]["base_revision"].startswith(BASE_REV[:7])
    # today's defaults reproduce the landed code bit for bit; fast does the same work (its own samples)
    assert res["work"]["defaults_equal_landed"] is True
    assert c["defaults"]["extra"] == {**c["landed"]["extra"], "per_stage_s": c["defaults"]["extra"]["per_stage_s"]}
    assert c["fast"]["extra"]["response_tokens"] > 0
    assert set(c["landed"]["extra"]["per_stage_s"]) >= {"generate-rollouts", "update-policies", "evaluate"}


def test_bench_help_lists_every_suite():
    from hacrl.study.bench.runner import SUITES

    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "bench", "--help"], cwd=ROOT, capture_output=True, text=True)
    text = " ".join(p.stdout.split())
    assert p.returncode == 0 and all(s in text for s in SUITES), text
