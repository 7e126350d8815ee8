"""A stage's inputs are checked before it reads them: each artifact another stage wrote must
exist, be what that stage wrote, by the hash DVC recorded for it (``dvc.lock``), and, for a
directory, say so itself: its manifest (``_artifact.json``) names the artifact and the stage
that wrote it, so that a lock edited to give one artifact another's content is caught.

``dvc repro`` alone would not catch a damaged input: a consumer stage run on its own (``dvc
repro --single-item``, a Prefect task, ``hacrl stage``) sees a changed dependency, runs on it
and records the damaged hash. Here the consumer compares each upstream output it depends on
(per ``dvc.yaml``) with the hash its producer's entry in ``dvc.lock`` holds, and a mismatch is a
one-line error naming the file, the producer and the way back (``dvc checkout`` from the cache,
or re-running the producer). Without ``dvc.yaml``/``dvc.lock`` (``hacrl run``, the comparison
suites) there is no record and nothing is checked.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from pathlib import Path

import yaml

from hacrl.errors import DataError


class DamagedInput(DataError):
    """An input is missing, or is not what the stage that writes it wrote (exit 2: rerunning the
    same stage on the same input cannot help)."""


def _load(path: Path) -> dict:
    """A YAML file of the pipeline (dvc.yaml, dvc.lock, params.yaml); a broken one is one line
    naming the file and the line, not a parser traceback."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        with open(path) as f:
            doc = yaml.load(f, Loader=loader) or {}  # noqa: S506 - a safe loader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise DamagedInput(f"{path.name}{f':{mark.line + 1}' if mark is not None else ''}: not valid YAML "
                           f"({getattr(e, 'problem', None) or e}); "
                           + ("`git checkout dvc.lock` restores the committed one" if path.name == "dvc.lock"
                              else "fix or regenerate it")) from None
    if not isinstance(doc, dict):
        raise DamagedInput(f"{path.name}: not a mapping (a {type(doc).__name__})")
    return doc


_VAR = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _resolve(entry: dict, it: int | None, params: dict | None = None) -> dict:
    """A stage of dvc.yaml with its paths' ``${...}`` filled in as DVC fills them: ``item.it``
    and ``item.prev`` of a foreach stage, any other name from params.yaml; normalised."""
    body = entry.get("do", entry)
    values = {"item.it": it, "item.prev": None if it is None else it - 1}

    def value(m: re.Match) -> str:
        name = m.group(1)
        if name in values:
            return m.group(0) if values[name] is None else str(values[name])
        v: object = params or {}
        for part in name.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        return m.group(0) if v is None or isinstance(v, (dict, list)) else str(v)

    def paths(items: list) -> list[str]:
        raw = [next(iter(x)) if isinstance(x, dict) else x for x in items or []]
        return [posixpath.normpath(_VAR.sub(value, p)) for p in raw]

    return {"deps": paths(body.get("deps")), "outs": paths(body.get("outs"))}


def _stages(spec: dict, stage_id: str, params: dict | None = None) -> dict | None:
    base, _, suffix = stage_id.partition("@")
    entry = spec.get("stages", {}).get(base)
    if entry is None:
        return None
    it = int(suffix[2:]) if suffix.startswith("it") and suffix[2:].isdigit() else None
    return _resolve(entry, it, params)


def producer_of(spec: dict, path: str) -> str | None:
    """The ``dvc.yaml`` stage that writes ``path`` (``runs/it3/rollouts`` -> ``generate-rollouts@it3``)."""
    m = re.search(r"(?:^|/)it(\d+)(?:/|$)", path)
    stages = spec.get("stages", {})
    for name, entry in stages.items():  # the plain stages first (runs/it0/... is prepare-pool's)
        if "foreach" not in entry and path in _resolve(entry, None)["outs"]:
            return name
    if m and int(m.group(1)) >= 1:  # RL iterations start at 1
        it = int(m.group(1))
        for name, entry in stages.items():
            if "foreach" in entry and path in _resolve(entry, it)["outs"]:
                return f"{name}@it{it}"
    return None


def _differing_file(project: Path, path: Path, md5: str) -> str:
    """Which file of directory ``path`` differs from DVC's record (its ``.dir`` manifest in the
    cache), else the directory itself."""
    from hacrl.hashes import file_md5

    manifest = project / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    if not manifest.is_file():
        return str(path)
    want = {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())}
    have = {f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file()}
    for rel in sorted(want):
        if rel not in have:
            return f"{path / rel} (missing)"
        if file_md5(path / rel) != want[rel]:
            return str(path / rel)
    extra = sorted(have - set(want))
    return f"{path / extra[0]} (not written by it)" if extra else str(path)


def _hash(project: Path, path: Path) -> str:
    from hacrl.hashes import cached_dvc_hash

    return cached_dvc_hash(project, path)


def verify(project: str | os.PathLike, stage_id: str) -> list[str]:
    """Check the upstream outputs ``stage_id`` depends on; return the paths checked.

    Raises :class:`DamagedInput` naming the first input that is missing or differs from what its
    producer wrote (by ``dvc.lock``).
    """
    project = Path(project)
    if not (project / "dvc.yaml").is_file():
        return []
    spec = _load(project / "dvc.yaml")
    params = _load(project / "params.yaml") if (project / "params.yaml").is_file() else {}
    stage = _stages(spec, stage_id, params)
    if stage is None:
        return []
    lock = _load(project / "dvc.lock").get("stages", {}) if (project / "dvc.lock").is_file() else {}
    recorded = {posixpath.normpath(o["path"]): (o.get("md5"), name) for name, st in lock.items()
                for o in st.get("outs", [])}
    checked = []
    for dep in stage["deps"]:
        producer = recorded[dep][1] if dep in recorded else producer_of(spec, dep)
        if producer is None:
            continue  # code, or a file no stage writes
        path = project / dep
        if not path.exists():
            raise DamagedInput(f"{dep}: missing; {producer} writes it (`dvc repro {producer}`)")
        if dep not in recorded:
            # written outside DVC (`hacrl stage`, a killed run) or its record was removed: nothing
            # says what it is, so nothing reads it
            raise DamagedInput(f"{dep}: dvc.lock has no record of {producer} writing it (it ran outside DVC, or "
                               f"its entry was removed): `dvc commit {producer}` adopts what is there, "
                               f"`dvc repro {producer}` writes it again")
        md5 = recorded[dep][0]
        if md5 and _hash(project, path) != md5:
            what = _differing_file(project, path, md5) if path.is_dir() else dep
            raise DamagedInput(f"{what}: not what {producer} wrote (dvc.lock has another hash): damaged or "
                               f"edited; `dvc checkout --force {dep}` restores it from the cache, `dvc repro {producer}` "
                               f"writes it again")
        if path.is_dir():
            check_manifest(path, dep, producer)
        checked.append(dep)
    return checked


def check_manifest(path: Path, dep: str, producer: str) -> None:
    """Directory ``path`` (``dep`` in dvc.yaml) must say it is ``producer``'s output ``dep`` and
    hold the files it lists: ``dvc.lock``'s hash alone would accept another artifact's content
    recorded under this name (an edited lock: iteration 5's rollouts checked out as iteration 6's)."""
    from hacrl.storage import MANIFEST, manifest_of

    man = path / MANIFEST
    fix = f"`dvc repro --force {producer}` writes it again"
    try:
        doc = json.loads(man.read_text())
    except FileNotFoundError:
        raise DamagedInput(f"{dep}: no {MANIFEST} inside: not an artifact a stage finished (written by hand, or "
                           f"by a hacrl before manifests); {fix}") from None
    except (OSError, ValueError) as e:
        raise DamagedInput(f"{dep}/{MANIFEST}: unreadable ({e}); {fix}") from None
    said = (doc.get("artifact"), doc.get("stage")) if isinstance(doc, dict) else (None, None)
    if said != (dep, producer):
        raise DamagedInput(f"{dep}: holds {said[0]} (written by {said[1]}), not {producer}'s {dep}: dvc.lock "
                           f"records another artifact's content under this name (edited?); `git checkout dvc.lock` "
                           f"and `dvc checkout {dep}` restore the committed one, {fix}")
    have = manifest_of(path, {})["files"]
    if have != doc.get("files"):
        diff = sorted(set(have.items()) ^ set((doc.get("files") or {}).items()))
        raise DamagedInput(f"{path / diff[0][0]}: not as {producer} wrote it (its {MANIFEST} lists other files or "
                           f"sizes); {fix}")


EXTERNAL_DIR = "data/external"
"""Where the ``external-input`` stages write one stamp per input outside the repository."""


def stamp(project: str | os.PathLike, key: str, params: str | os.PathLike = "params.yaml") -> Path:
    """The ``external-input@KEY`` stage: write ``data/external/KEY.json`` holding the content
    hash of the input (a file's md5, a directory's DVC tree hash), so that the stages reading it
    (prepare-data, prepare-pool) are stale exactly when its content changed. The placeholder
    entry (nothing external) gets a constant stamp."""
    from hacrl.errors import ConfigError
    from hacrl.hashes import dvc_hash
    from hacrl.pipeline.params import read_with_vars, vars_path
    from hacrl.storage import atomic_write_text

    project = Path(project)
    entries = read_with_vars(project / params).get("external_inputs") or {}
    if key not in entries:
        raise ConfigError(f"external input {key!r}: not in {vars_path(params).name} (has: "
                          f"{', '.join(entries) or 'none'}); run `hacrl config`")
    path = Path(entries[key]["path"])
    path = path if path.is_absolute() else project / path
    if key == "none":
        doc = {"input": key}
    elif not path.exists():
        raise DataError(f"{entries[key]['path']}: does not exist (external input {key})")
    else:
        doc = {"input": key, "md5": dvc_hash(path)}
    out = project / EXTERNAL_DIR / f"{key}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(doc, sort_keys=True) + "\n")
    return out
