"""The settings reference, written from the schema itself: ``hacrl config --doc`` prints it and
``docs/CONFIG.md`` is it (``tests/config/test_config.py`` checks they agree, so it cannot drift).

Every key of :class:`hacrl.config.schema.Config` with its type, its default, its rule and the
docstring written under its field in ``schema.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import typing
from typing import Any

from hacrl.config import schema

SECTIONS_INTRO = """# Settings

Every setting of `params.yaml`, generated from `src/hacrl/config/schema.py` (its one home: the
default, the type, the rule and what it does) by `hacrl config --doc`. `conf/` holds presets
that change some of these (a pool, an algorithm, an experiment's budgets); `hacrl config KEY=VALUE`
changes one. A value that breaks its rule stops `hacrl config` and every stage with one line
naming the key. The options of a registered advantage estimator or loss
(`algorithm.advantage.*`, `algorithm.loss.*`) are listed by `hacrl algorithms`.
"""


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (its source, parsed)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(getattr(nxt, "value", None), ast.Constant) and isinstance(nxt.value.value, str):
            text = " ".join(inspect.cleandoc(nxt.value.value).split())
            out[node.target.id] = re.sub(r":(?:mod|func|class|data|meth):`", "`", text).replace("``", "`")
    return out


def _type(t: Any) -> str:
    if t is type(None):
        return "null"
    args = typing.get_args(t)
    origin = typing.get_origin(t)
    if args and origin not in (list, dict):
        return " or ".join(_type(a) for a in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"map to {_type(args[1])}"
    return getattr(t, "__name__", str(t)).replace("Any", "any")


def _rule(f: dataclasses.Field) -> str:
    r = f.metadata.get("rule")
    if r is None:
        return ""
    parts = []
    if r.choices is not None:
        parts.append("one of " + ", ".join(f"`{c}`" for c in r.choices))
    if r.lo is not None:
        parts.append(f"{'>' if r.lo_open else '>='} {schema._num(r.lo)}")
    if r.hi is not None:
        parts.append(f"{'<' if r.hi_open else '<='} {schema._num(r.hi)}")
    if r.pattern is not None:
        parts.append(r.why or f"matches `{r.pattern}`")
    elif r.why:
        parts.append(f"({r.why})")
    return ", ".join(parts)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(v):
            return ""
        if isinstance(v, list) and v and dataclasses.is_dataclass(v[0]):
            v = [dataclasses.asdict(x) for x in v]
    else:
        return ""
    text = repr(v).replace("'", '"').replace("None", "null").replace("True", "true").replace("False", "false")
    return f"`{text}`".replace("|", "\\|")


def _rows(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    rows: list[str] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            rows += _rows(t, f"{key}.")
            continue
        args = typing.get_args(t)
        if typing.get_origin(t) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
            rows.append(f"| `{key}` | map to {args[1].__name__} | `{{}}` | | {docs.get(f.name, '')} |")
            rows += _rows(args[1], f"{key}.NAME.")
            continue
        if typing.get_origin(t) is list and args and dataclasses.is_dataclass(args[0]):
            rows.append(f"| `{key}` | list | {_default(f)} | {_rule(f)} | {docs.get(f.name, '')} |")
            rows += _rows(args[0], f"{key}[i].")
            continue
        doc = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{key}` | {_type(t)} | {_default(f)} | {_rule(f)} | {doc} |")
    return rows


def reference() -> str:
    """The settings reference as Markdown, one table per section of the config."""
    lines = [SECTIONS_INTRO]
    hints = typing.get_type_hints(schema.Config)
    for f in dataclasses.fields(schema.Config):
        t = hints[f.name]
        cls = t if dataclasses.is_dataclass(t) else typing.get_args(t)[0]
        head = f"## `{f.name}`" + (" (a list: one entry per agent)" if not dataclasses.is_dataclass(t) else "")
        doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else None
        doc = re.sub(r":(?:mod|func|class|data|meth):`", "`", " ".join(doc.split())).replace("``", "`") if doc else None
        lines += [head, ""] + ([doc, ""] if doc else [])
        lines += ["| key | type | default | rule | what it does |", "|---|---|---|---|---|"]
        lines += _rows(cls, f"{f.name}." if dataclasses.is_dataclass(t) else f"{f.name}[i].")
        lines.append("")
    return "\n".join(lines)
