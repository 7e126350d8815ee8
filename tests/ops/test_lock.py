"""The dvc.lock of the checkout matches its code and params (CI: a clean clone, so the committed ones): otherwise a fresh clone's
`make run` re-runs stages whose code "changed" and leaves `git status` dirty (a docstring edit
to a stage's module without a `dvc repro` did exactly that once)."""

import hashlib

import yaml

from conftest import ROOT


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def test_every_code_dependency_in_the_lock_is_the_committed_file():
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    stale = sorted({(dep["path"], name) for name, st in lock.items() for dep in st.get("deps", [])
                    if dep["path"].startswith(("src/", "conf/")) and (ROOT / dep["path"]).is_file()
                    and _md5(ROOT / dep["path"]) != dep["md5"]})
    assert not stale, f"dvc.lock records other versions of these files (run `dvc repro`, commit dvc.lock): {stale[:5]}"


def _norm(v):
    """Values as DVC compares them (PyYAML reads `1e-06` as a string, YAML 1.2 as a float)."""
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_norm(x) for x in v]
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def test_every_parameter_in_the_lock_is_the_committed_params_yaml():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    differ = [(name, key) for name, st in lock.items() for key, val in st.get("params", {}).get("params.yaml", {}).items()
              if _norm(_get(params, key)) != _norm(val)]
    assert not differ, f"dvc.lock was made with other params (run `dvc repro`, commit dvc.lock): {differ[:5]}"


def test_every_stage_in_the_lock_lists_the_dependencies_dvc_yaml_gives_it():
    """A file added to (or renamed in) a stage's deps in dvc.yaml changes the stage for DVC even
    when no hash moved: a lock whose dependency lists lag makes a fresh clone rerun the stage (a
    rename in the package left them stale once; the hash checks above skip files that are gone)."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    with Repo(str(ROOT)) as repo:
        stages = list(repo.index.stages)
    differ = []
    for st in stages:
        want = sorted(str(d.def_path) for d in st.deps if not isinstance(d, ParamsDependency))
        have = sorted(d["path"] for d in lock.get(st.addressing, {}).get("deps", []))
        if want != have:
            differ.append((st.addressing, sorted(set(want) ^ set(have))))
    assert not differ, f"dvc.lock lists other dependencies than dvc.yaml (run `dvc repro`, commit dvc.lock): {differ[:3]}"
