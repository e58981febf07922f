"""Folders ``demind-publish`` wrote before it recorded their file list: the one home of that layout
(:func:`demind.release.folders.published_files` calls in here and nowhere else knows it).

Such a folder's ``config.json`` has no ``files`` list; the files of its fixed layout are taken as the
ones demind-publish wrote, so ``--overwrite`` replaces it as it replaces a current one.
"""

from __future__ import annotations

LEGACY_FILES = ("demind.safetensors", "config.json", "README.md", "training_config.yaml")
LEGACY_FOLDERS = ("backbone", "results")
"""What a folder published before the file list was recorded may hold."""


def earlier_published_files(files: set[str]) -> set[str]:
    """Of a folder's ``files`` (relative POSIX paths), those of the fixed layout demind-publish wrote."""
    return {f for f in files if f in LEGACY_FILES or f.split("/", 1)[0] in LEGACY_FOLDERS}
