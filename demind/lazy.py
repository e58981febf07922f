"""Lazy package faces: a package's public names imported on first use (PEP 562).

A package whose ``__init__`` imported every module up front would make ``import demind.training.config``
(a dataclass) load torch and the whole trainer; ``--help`` of a command must not. The face still
offers the same names (``from demind.training import train``), each resolved once, when first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, list[str]]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose names live in submodules:
    ``where = {"demind.training.loop": ["train", "EXPORT_NAME"], ...}``."""
    home = {name: module for module, names in where.items() for name in names}
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home[name]), name)
        namespace[name] = value  # resolved once; later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(home))

    return __getattr__, __dir__
