"""An index's ``index.json``, the finished build's done-marker: its format, the checks that make a
damaged one an error naming the file, the key and the rebuild (:mod:`demind.search.index` writes it),
and where the index's images live.
"""

from __future__ import annotations

import logging
from pathlib import Path

from demind.errors import DemindError, InputError
from demind.io import read_json
from demind.search.index_upgrade import EARLIER_FORMATS, upgrade_manifest

log = logging.getLogger(__name__)

INDEX_FORMAT = "demind-index/2"  # /2: names once, rows stored normalised (float16) in parts listed in order
MANIFEST = "index.json"


class GalleryIndexError(DemindError, ValueError):
    """An index that cannot be used as asked (missing, unfinished, or another backbone's)."""


class DamagedManifestError(GalleryIndexError):
    """A demind index whose ``index.json`` is truncated or holds wrong-typed keys: ``demind-index``
    rebuilds it (reusing the stored embeddings); searching it needs that rebuild first."""


def rebuild_advice(index_dir: Path, root: str | None = None) -> str:
    return f"rerun demind-index --images {root or 'DIR'} --index {index_dir} (with its --checkpoint) to rebuild it"


MANIFEST_TYPES = {"format": str, "root": str, "backbone_slug": str, "precision": str, "embed_dim": int,
                  "images": list, "unreadable": dict}
V2_TYPES = {"parts": list, "dtype": str}


def read_manifest(index_dir: Path) -> dict | None:
    """The finished build's ``index.json``, None when there is none; a damaged one is a
    GalleryIndexError naming the file, the key and how to rebuild it. One of an earlier layout is
    read as its upgrade module reads it (:mod:`demind.search.index_upgrade`)."""
    path = index_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = read_json(path, fix=rebuild_advice(index_dir))
    except InputError as e:
        raise DamagedManifestError(str(e)) from None
    if not isinstance(manifest, dict):
        # not ours to overwrite: someone else's index.json, or a file put there by hand
        raise GalleryIndexError(f"{path} is not a demind index (a JSON {type(manifest).__name__}, not an object); "
                                f"choose another --index folder, or delete {path} to build a new index there")
    if manifest.get("format") not in (INDEX_FORMAT, *EARLIER_FORMATS):
        raise GalleryIndexError(f"{path} is not a demind index (format {manifest.get('format')!r}, "
                                f"expected {INDEX_FORMAT!r})")
    root = manifest.get("root") if isinstance(manifest.get("root"), str) else None

    def damaged(what: str) -> DamagedManifestError:
        return DamagedManifestError(f"{path}: {what}; " + rebuild_advice(index_dir, root))

    _check_types(manifest, MANIFEST_TYPES, damaged)
    if manifest["format"] != INDEX_FORMAT:
        return upgrade_manifest(manifest, damaged)
    _check_types(manifest, V2_TYPES, damaged)
    if not (all(isinstance(e, str) for e in manifest["images"]) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], int)
            for p in manifest["parts"]) and sum(p[1] for p in manifest["parts"]) == len(manifest["images"])):
        raise damaged("keys 'images' (names) and 'parts' ([part, rows] pairs) do not match")
    return manifest


def _check_types(manifest: dict, types: dict[str, type], damaged) -> None:
    """Raise ``damaged(...)`` naming the first key of ``types`` whose value is not of its JSON type."""
    for key, kind in types.items():
        if not isinstance(manifest.get(key), kind):
            raise damaged(f"key {key!r} must be a JSON {kind.__name__}, got {type(manifest.get(key)).__name__}")


def previous_manifest(index_dir: Path, images: Path) -> tuple[dict, bool]:
    """(the last finished build's manifest, whether it was damaged). A damaged one is logged and
    read as none: the build then starts afresh, reusing every stored embedding whose key matches."""
    empty = {"images": [], "unreadable": {}, "root": None}
    try:
        return read_manifest(index_dir) or empty, False
    except DamagedManifestError as e:
        log.warning("%s -- rebuilding the index from %s now (stored embeddings are reused)", e, images)
        return empty, True


def recorded_root(index_dir: Path, manifest: dict) -> Path:
    """Where the index's images live: the folder recorded relative to the index when it exists there
    (index and images moved together), else the absolute one (the index moved alone, or an older index)."""
    relative = manifest.get("root_relative")
    if isinstance(relative, str) and (index_dir / relative).is_dir():
        return (index_dir / relative).resolve()
    return Path(manifest["root"])
