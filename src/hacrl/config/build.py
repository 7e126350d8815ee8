"""How the typed settings are built from YAML: types, unknown keys, rules, all in one line.

:func:`build` makes any settings dataclass (a section of :class:`hacrl.config.schema.Config`, or
the options dataclass of a registered algorithm) from a plain mapping: an unknown key, a value of
the wrong type or one that breaks its field's rule is a :class:`~hacrl.errors.ConfigError` whose
one line names the full key, the value and what was expected. Nothing is guessed: ``'1.0'`` (a
quoted string) is not a number, ``'false'`` is not false; an integer where a number is expected
becomes a float. YAML is read and written as Hydra and DVC read it (YAML 1.2 numbers).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from hacrl.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
"""The project's Hydra config directory (presets); the project root is its parent."""

_WORDS = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}


def build(cls: type, data: Any, key: str = "") -> Any:
    """The dataclass ``cls`` from mapping ``data`` (``key``: its path in the config, for errors).

    Fields not in ``data`` take their defaults; keys starting with ``_`` are ignored."""
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if isinstance(k, str) and k.startswith("_"):
            continue
        sub = f"{key}.{k}" if key else str(k)
        if k not in fields:
            raise ConfigError(f"{sub}: unknown key (value {v!r})")
        kwargs[k] = _value(v, hints[k], sub)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a field's rule or a check across fields: FIELD: ... -> KEY.FIELD: ...
        raise ConfigError(f"{key}.{e}" if key else str(e)) from None


def _value(v: Any, t: Any, key: str) -> Any:
    """``v`` as type ``t``: a nested settings dataclass, a list or mapping of them, or a scalar."""
    if dataclasses.is_dataclass(t):
        return build(t, v, key)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        if not isinstance(v, list):
            raise ConfigError(f"{key}: expected a list, got {v!r}")
        return [build(args[0], x, f"{key}[{i}]") for i, x in enumerate(v)]
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        if not isinstance(v, dict):
            raise ConfigError(f"{key}: expected a mapping, got {v!r}")
        return {str(n): build(args[1], x, f"{key}.{n}") for n, x in v.items()}
    return typed(v, t, key)


def _expected(t: Any) -> str:
    words = []
    for x in (typing.get_args(t) if _is_union(t) else (t,)):
        origin, args = typing.get_origin(x), typing.get_args(x)
        if x is type(None):
            words.append("null")
        elif origin is list:
            words.append(f"a list of {_WORDS.get(args[0], str(args[0])).removeprefix('an ').removeprefix('a ')}s")
        elif origin is dict:
            words.append(f"a mapping to {_WORDS.get(args[1], str(args[1])).removeprefix('an ').removeprefix('a ')}s")
        else:
            words.append(_WORDS.get(x, getattr(x, "__name__", str(x))))
    return " or ".join(words)


def _is_union(t: Any) -> bool:
    return typing.get_origin(t) in (typing.Union, types.UnionType)


def _scalar_ok(v: Any, t: Any) -> bool:
    if t is Any:
        return True
    if t is float:  # inf and nan pass no range check and poison what they reach
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if t in (str, bool):
        return isinstance(v, t)
    return True  # a type this check does not know is left to the checks


def typed(v: Any, t: Any, key: str) -> Any:
    """``v`` as type ``t`` or a one-line ConfigError naming the key, the value and the type expected."""
    opts = typing.get_args(t) if _is_union(t) else (t,)
    if v is None:
        if type(None) in opts or Any in opts:
            return None
        raise ConfigError(f"{key}: invalid value None (expected {_expected(t)})")
    base = [x for x in opts if x is not type(None)]
    if len(base) != 1:
        return v
    b = base[0]
    bad = ConfigError(f"{key}: invalid value {v!r} (expected {_expected(t)})")
    origin, args = typing.get_origin(b), typing.get_args(b)
    if origin is list:
        if not isinstance(v, list) or not all(_scalar_ok(x, args[0]) for x in v):
            raise bad
        return [float(x) for x in v] if args[0] is float else v
    if origin is dict:
        if not isinstance(v, dict) or not all(_scalar_ok(x, args[1]) for x in v.values()):
            raise bad
        return {k: float(x) for k, x in v.items()} if args[1] is float else v
    if not _scalar_ok(v, b):
        raise bad
    return float(v) if b is float else v


# ----------------------------------------------------------------------------- YAML as Hydra and DVC read it

class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``5e-4`` as the float YAML 1.2 (Hydra, DVC) reads, not as
    a string (YAML 1.1 wants a dot in a float). Aliases (``*name``) are refused: nothing this
    project writes has one, and nested aliases expand exponentially (a "billion laughs" file)."""

    def compose_node(self, parent, index):  # noqa: D102 - PyYAML's hook
        if self.check_event(yaml.AliasEvent):
            ev = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"an alias (*{ev.anchor}): YAML aliases are not accepted",
                                              ev.start_mark)
        return super().compose_node(parent, index)


class Yaml12Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting every string the YAML 1.2 reader would take for a number
    (``'2e4'``, a commit id such as ``'7e69083'``), so a file reads back as it was written."""


_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
for _cls in (Yaml12Loader, Yaml12Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def read_yaml(path: str | os.PathLike) -> Any:
    """A YAML file as Hydra and DVC read it (``5e-4`` is a number); a syntax error is one line."""
    try:
        with open(path) as f:
            return yaml.load(f, Loader=Yaml12Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None


def dump_yaml(data: Any) -> str:
    """``data`` as YAML that :func:`read_yaml` reads back unchanged (keys in their order)."""
    return yaml.dump(data, Dumper=Yaml12Dumper, sort_keys=False)
