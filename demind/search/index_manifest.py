"""An index's ``index.json``, the finished build's done-marker: its format, the checks that make a
damaged one an error naming the file, the key and the rebuild (:mod:`demind.search.index` writes it),
and where the index's images live.
"""

from __future__ import annotations

import logging
from pathlib import Path

from demind.errors import DemindError, InputError
from demind.io import read_json

log = logging.getLogger(__name__)

INDEX_FORMAT = "demind-index/2"  # /2: names once, rows stored normalised (float16) in parts listed in order
LEGACY_FORMAT = "demind-index/1"  # /1: [name, key] pairs, raw float32 parts found by key (still read)
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
    GalleryIndexError naming the file, the key and how to rebuild it."""
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
    if manifest.get("format") not in (INDEX_FORMAT, LEGACY_FORMAT):
        raise GalleryIndexError(f"{path} is not a demind index (format {manifest.get('format')!r}, "
                                f"expected {INDEX_FORMAT!r})")
    root = manifest.get("root") if isinstance(manifest.get("root"), str) else None
    legacy = manifest["format"] == LEGACY_FORMAT
    for key, kind in {**MANIFEST_TYPES, **({} if legacy else V2_TYPES)}.items():
        if not isinstance(manifest.get(key), kind):
            raise DamagedManifestError(f"{path}: key {key!r} must be a JSON {kind.__name__}, got "
                                    f"{type(manifest.get(key)).__name__}; " + rebuild_advice(index_dir, root))
    if legacy and not all(isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e)
                          for e in manifest["images"]):
        raise DamagedManifestError(f"{path}: key 'images' must list [name, key] pairs of strings; "
                                + rebuild_advice(index_dir, root))
    if not legacy and not (all(isinstance(e, str) for e in manifest["images"]) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], int)
            for p in manifest["parts"]) and sum(p[1] for p in manifest["parts"]) == len(manifest["images"])):
        raise DamagedManifestError(f"{path}: keys 'images' (names) and 'parts' ([part, rows] pairs) do not match; "
                                   + rebuild_advice(index_dir, root))
    return manifest


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
