"""A module imported on first use, so that cheap processes do not pay for heavy imports.

Config validation reads the algorithm registry (names, options dataclasses), which lives beside
the tensor functions; importing torch for it cost every stage process about 1-2 s, including
stages that touch no tensor. ``torch = lazy_module("torch", globals())`` binds a stand-in that
imports torch at the first attribute access and then replaces itself in the module's globals,
so later lookups are plain module attribute lookups.
"""

from __future__ import annotations

import importlib
from typing import Any


class _LazyModule:
    def __init__(self, name: str, namespace: dict[str, Any], alias: str):
        self._name, self._namespace, self._alias = name, namespace, alias

    def __getattr__(self, attr: str) -> Any:
        mod = importlib.import_module(self._name)
        self._namespace[self._alias] = mod
        return getattr(mod, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_module(name: str, namespace: dict[str, Any], alias: str | None = None) -> Any:
    """A stand-in for ``import name`` bound in ``namespace`` (a module's ``globals()``)."""
    return _LazyModule(name, namespace, alias or name.rsplit(".", 1)[-1])
