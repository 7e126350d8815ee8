"""The layer contract holds, and it is not toothless: an upward import or a cycle planted in a
copy of the package, even inside a function, breaks it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(root / "src"), "PATH": str(LINT.parent), "HOME": str(root)}
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture()
def copy(tmp_path):
    shutil.copytree(ROOT / "src" / "hacrl", tmp_path / "src" / "hacrl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _plant(root: Path, module: str, line: str) -> None:
    f = root / "src" / (module.replace(".", "/") + ".py")
    f.write_text(f.read_text() + f"\n\ndef _planted():\n    {line}  # noqa: F401\n")


def test_the_package_keeps_its_layers(copy):
    p = _lint(copy)
    assert p.returncode == 0 and "2 kept, 0 broken" in p.stdout, p.stdout + p.stderr


def test_an_upward_import_inside_a_function_breaks_the_contract(copy):
    _plant(copy, "hacrl.config.schema", "from hacrl.pipeline import params")
    p = _lint(copy)
    assert p.returncode != 0 and "BROKEN" in p.stdout, p.stdout + p.stderr
    assert "hacrl.config.schema -> hacrl.pipeline.params" in p.stdout


def test_a_cycle_inside_a_layer_breaks_the_contract(copy):
    _plant(copy, "hacrl.pipeline.table", "from hacrl.pipeline import in_process")
    p = _lint(copy)
    assert p.returncode != 0 and "No cycles between the modules of any package BROKEN" in p.stdout, p.stdout


def test_package_init_files_are_empty():
    """Nothing is re-exported: importing a package costs nothing, and a module's imports are all
    it pays for (the config check stays torch-free, the stage server's preload is what it says)."""
    full = [str(f.relative_to(ROOT)) for f in (ROOT / "src" / "hacrl").rglob("__init__.py")
            if f.parent.name != "hacrl" and f.read_text().strip()]
    assert not full, full
