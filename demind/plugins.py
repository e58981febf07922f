"""Image towers from other packages, found through the ``demind.plugins`` entry-point group.

open_clip builds a ``timm_model_name`` only if timm knows it. A package that adds towers of its
own (the toy world's convnet: ``toyworld.towers``) registers them with timm when imported, and
declares that module in its metadata::

    [project.entry-points."demind.plugins"]
    toy = "toyworld.towers"

:func:`require_timm_model` imports those modules, lazily and once, the first time a model config
names a tower timm does not know, so ``demind`` never imports a plugin package by name.
"""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from pathlib import Path
from typing import Any

from demind.errors import DemindError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "demind.plugins"
_loaded: set[str] = set()  # entry-point values already imported (a failed import is retried)


class MissingTowerError(DemindError, ValueError):
    """A model config names a timm tower that neither timm nor any installed plugin provides."""


def plugin_entry_points() -> list[metadata.EntryPoint]:
    """The installed ``demind.plugins`` entry points (importlib.metadata; one API since Python 3.10)."""
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def load_plugins() -> list[str]:
    """Import every plugin module not imported yet; returns the entry-point values imported now."""
    loaded = []
    for entry in plugin_entry_points():
        if entry.value in _loaded:
            continue
        importlib.import_module(entry.value)  # registering is the import's side effect
        _loaded.add(entry.value)
        loaded.append(entry.value)
        log.debug("loaded demind plugin %s = %s", entry.name, entry.value)
    return loaded


def timm_knows(name: str) -> bool:
    import timm

    return timm.is_model(name)


def require_timm_model(model_config: dict[str, Any] | None, source: str | Path) -> None:
    """Make sure timm can build the image tower a model config names (``vision_cfg.timm_model_name``).

    Nothing to do for configs without a timm tower or with one timm knows; otherwise the plugins are
    loaded, and a tower still unknown after that raises :class:`MissingTowerError` naming ``source``
    (the model config) and the tower."""
    name = ((model_config or {}).get("vision_cfg") or {}).get("timm_model_name")
    if not name or timm_knows(name):
        return
    load_plugins()
    if timm_knows(name):
        return
    installed = ", ".join(f"{e.name} = {e.value}" for e in plugin_entry_points()) or "none"
    raise MissingTowerError(
        f"model config {source}: vision_cfg.timm_model_name {name!r} is not a timm model and no installed "
        f"'{ENTRY_POINT_GROUP}' plugin registers it (installed: {installed}); install the package that "
        f"provides it (for the toy world's towers: pip install -e . in the demind repository) or fix the name")
