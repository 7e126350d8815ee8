"""The stage table is the pipeline's shape: dvc.yaml, the CLI and the record types agree with it."""

import re

import yaml

from hacrl.exchange import experience
from hacrl.pipeline import table

from conftest import ROOT


def _dvc() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def test_dvc_yaml_runs_every_stage_of_the_table_and_nothing_else():
    spec = _dvc()
    want = {table.INPUT_STAGE}
    for s in table.STAGES:
        want.add(s.name)
        entry = spec[s.name]
        body = entry.get("do", entry)
        if s.kind == table.ITERATION:
            assert "foreach" in entry, s.name
            assert body["cmd"] == f"hacrl stage {s.name} --iteration ${{item.it}}", s.name
        else:
            assert "foreach" not in entry and body["cmd"] == f"hacrl stage {s.name}", s.name
        if s.at_zero:
            want.add(s.at_zero)
            assert spec[s.at_zero]["cmd"] == f"hacrl stage {s.name} --iteration 0"
    assert set(spec) == want


def test_every_stage_function_exists_and_its_module_is_a_code_dependency_of_its_dvc_stages():
    spec = _dvc()
    for s in table.STAGES:
        assert callable(s.load()), s.entry
        module_path = "src/" + s.entry.partition(":")[0].replace(".", "/") + ".py"
        for dvc_name in (s.name, *([s.at_zero] if s.at_zero else [])):
            body = spec[dvc_name].get("do", spec[dvc_name])
            assert module_path in body["deps"], (dvc_name, module_path)
    code = [d for st in spec.values() for d in st.get("do", st).get("deps", []) if d.startswith("src/")]
    assert code and all((ROOT / d).is_file() for d in code), [d for d in code if not (ROOT / d).is_file()]


def test_derived_views_of_the_table():
    assert table.iteration_stages() == ("generate-rollouts", "verify-rewards", "exchange-and-align",
                                        "compute-capability-stats", "update-policies", "evaluate")
    assert table.prepare_stages() == ("prepare-data", "prepare-pool", "evaluate-warmup")
    assert table.dvc_stage_id("evaluate", 0) == "evaluate-warmup"
    assert table.dvc_stage_id("update-policies", 3) == "update-policies@it3"
    assert table.dvc_stage_id("report", 0) == "report"
    assert table.of_dvc_stage("evaluate-warmup").name == "evaluate"
    assert table.of_dvc_stage("external-input@none") is None
    assert table.closes_iteration("evaluate") and not table.closes_iteration("update-policies")
    assert table.iteration_problem("update-policies", 0, 2) == "--iteration: invalid value 0 (RL iterations start at 1)"
    assert table.iteration_problem("evaluate", 0, 2) is None
    assert table.iteration_problem("evaluate", 3, 2).startswith("--iteration: invalid value 3 (iterations 0-2")


def test_the_record_types_name_stages_of_the_table():
    """A record's schema says which stage writes it (its error tells how to regenerate a file)."""
    assert set(experience._WRITTEN_BY.values()) <= set(table.names())


def test_the_stage_list_is_spelled_out_once_in_the_package():
    """No module but the table lists the stages (nor the flows, tasks, benchmarks and scripts): a
    new stage is one row (and its dvc.yaml entry), and nothing that runs the stages skips it."""
    names = table.names()
    # the table itself, and the record schemas' producers (checked against the table above)
    allowed = {"src/hacrl/pipeline/table.py", "src/hacrl/exchange/experience.py"}
    offenders = []
    files = [*(ROOT / "src" / "hacrl").rglob("*.py"), *(ROOT / "flows").glob("*.py"), *(ROOT / "tasks").glob("*.py"),
             *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*")]
    for f in sorted(files):
        if str(f.relative_to(ROOT)) in allowed:
            continue
        text = f.read_text()
        quoted = {n for n in names if re.search(rf"[\"']{re.escape(n)}[\"']", text)}
        if len(quoted) >= 3:  # a list of stages, not a mention of one
            offenders.append((str(f.relative_to(ROOT)), sorted(quoted)))
    assert not offenders, offenders
