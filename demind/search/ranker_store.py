"""Built FAISS rankers saved inside their index folder, so that a search or serve start reuses them.

Layout, beside the index's parts::

    rankers/<kind>.faiss     the FAISS index (faiss.write_index), written atomically
    rankers/<kind>.json      its record, written last (the done-marker): settings, build seconds,
                             recall@10 measured as it was built, the fingerprint of the index it
                             was built over and the .faiss file's size and sha256

The fingerprint is what the index's ``index.json`` says of its rows: the parts in order with their
row counts, the width and the stored dtype. ``demind-index`` writes new parts for new or changed
images and compacts into new parts when files go, so any change to the rows changes it. A saved
ranker is reused when its fingerprint and settings match the index and the ranker's current
settings (one log line: loaded, its recall); otherwise it is rebuilt and saved again (logged). A
missing, damaged or truncated file is one logged line and a rebuild, never a traceback. ``exact``
and ``faiss-flat`` build nothing and save nothing; neither does a ranker that searches exactly
(too few rows for lists).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from demind.errors import DemindError, InputError
from demind.io import atomic_path, read_json, write_json_atomic
from demind.search.index import GalleryIndex
from demind.search.index_manifest import MANIFEST
from demind.search.rankers import APPROXIMATE, Ranker, default_settings, exact_fallback, faiss_module

log = logging.getLogger(__name__)

FOLDER = "rankers"
FORMAT = "demind-ranker/1"


def saved_paths(index_dir: str | Path, kind: str) -> tuple[Path, Path]:
    """(FAISS file, json record) of the saved ``kind`` ranker of the index at ``index_dir``."""
    folder = Path(index_dir) / FOLDER
    return folder / f"{kind}.faiss", folder / f"{kind}.json"


def fingerprint(index_dir: str | Path) -> dict | None:
    """What identifies the index's rows, from its ``index.json``: {"parts": [[stem, rows], ...],
    "embed_dim", "dtype"}; None when there is no readable manifest with parts (a legacy or
    synthetic index: nothing is saved for it)."""
    try:
        manifest = read_json(Path(index_dir) / MANIFEST, fix="")
    except (InputError, OSError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("parts"), list):
        return None
    return {"parts": manifest["parts"], "embed_dim": manifest.get("embed_dim"), "dtype": manifest.get("dtype")}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_ranker(ranker: Ranker, index_dir: str | Path, built_over: dict | None = None) -> Path | None:
    """Write ``ranker`` (a built FAISS one) into ``index_dir``/rankers/, the FAISS file then its
    record, both atomically; returns the record's path. None (nothing written) for a ranker that
    builds nothing, an index without a fingerprint, or a folder that cannot be written (logged:
    the search goes on with the ranker it holds)."""
    built_over = built_over or fingerprint(index_dir)
    if ranker.faiss_index is None or ranker.kind not in APPROXIMATE or built_over is None:
        return None
    faiss_path, record_path = saved_paths(index_dir, ranker.kind)
    try:
        with atomic_path(faiss_path) as tmp:
            faiss_module().write_index(ranker.faiss_index, str(tmp))
        write_json_atomic(record_path, {
            "format": FORMAT, "kind": ranker.kind, "settings": ranker.settings, "rows": ranker.size,
            "build_s": round(ranker.build_s, 2), "recall_at_10": ranker.recall_at_10, "index": built_over,
            "file_bytes": faiss_path.stat().st_size, "sha256": _sha256(faiss_path)}, indent=1)
    except (DemindError, OSError) as e:
        log.warning("%s: could not save the built ranker in %s (%s); the next start builds it again", ranker.kind,
                    faiss_path.parent, e)
        return None
    return record_path


def _why_not_reusable(record: object, kind: str, built_over: dict, rows: int, faiss_path: Path) -> str | None:
    """Why a saved record cannot serve this index (None: it can, if its file reads)."""
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("kind") != kind:
        return "its record is not a saved-ranker record"
    if record.get("index") != built_over:
        return "the index changed since it was built (other parts)"
    current = default_settings(kind, rows, built_over["embed_dim"])
    if record.get("settings") != current:
        return f"its settings {record.get('settings')} are not the current {current}"
    if not isinstance(record.get("recall_at_10"), float) or not isinstance(record.get("build_s"), (int, float)):
        return "its record lacks its recall or build time"
    if not faiss_path.is_file() or faiss_path.stat().st_size != record.get("file_bytes"):
        return f"{faiss_path.name} is missing or not the size recorded (damaged)"
    if _sha256(faiss_path) != record.get("sha256"):
        return f"{faiss_path.name} does not match its recorded checksum (damaged)"
    return None


def load_ranker(index: GalleryIndex, kind: str, built_over: dict | None = None) -> Ranker | None:
    """The saved ``kind`` ranker of ``index`` when it was built over these very rows with the
    current settings; None otherwise, with one log line saying why (nothing saved: nothing said)."""
    built_over = built_over or fingerprint(index.directory)
    faiss_path, record_path = saved_paths(index.directory, kind)
    if built_over is None or not record_path.is_file():
        return None
    try:
        record = read_json(record_path, fix="")
        why = _why_not_reusable(record, kind, built_over, len(index), faiss_path)
        if why is None:
            start = time.perf_counter()
            faiss_index = faiss_module().read_index(str(faiss_path))
            if faiss_index.ntotal != len(index) or faiss_index.d != built_over["embed_dim"]:
                why = f"{faiss_path.name} holds {faiss_index.ntotal} rows of width {faiss_index.d}, not the index's"
    except (InputError, OSError, RuntimeError) as e:  # RuntimeError: FAISS could not read the file
        why = f"it cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if why is not None:
        log.info("%s: not reusing the saved ranker %s: %s; building it again", kind, faiss_path, why)
        return None
    ranker = Ranker.from_faiss(index.blocks, kind, faiss_index, record["build_s"], record["recall_at_10"])
    ranker.saved_at = faiss_path
    log.info("%s: loaded the saved ranker %s in %.1f s (%s; recall@10 %.3f against exact search, measured when it "
             "was built in %.1f s)", kind, faiss_path, time.perf_counter() - start,
             ", ".join(f"{k} {v}" for k, v in ranker.settings.items()), ranker.recall_at_10, ranker.build_s)
    return ranker


def remove_stale_rankers(index_dir: str | Path) -> list[str]:
    """Delete the saved rankers built over an earlier state of the index at ``index_dir`` (another
    fingerprint: they can never be loaded again, and a 1M-row HNSW file is about 2 GB), each with
    one log line. Returns the kinds removed. A record that cannot be read is left (a start says why)."""
    current, removed = fingerprint(index_dir), []
    folder = Path(index_dir) / FOLDER
    if current is None or not folder.is_dir():
        return removed
    for record_path in sorted(folder.glob("*.json")):
        try:
            record = read_json(record_path, fix="")
        except (InputError, OSError):
            continue
        if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("index") == current:
            continue
        faiss_path = record_path.with_suffix(".faiss")
        size = faiss_path.stat().st_size if faiss_path.is_file() else 0
        record_path.unlink()  # the record first: a kill between leaves a file no record vouches for
        faiss_path.unlink(missing_ok=True)
        log.info("removed the saved ranker %s (%.1f MB): built over an earlier state of the index", faiss_path,
                 size / 1e6)
        removed.append(record_path.stem)
    return removed


def open_ranker(index: GalleryIndex, kind: str) -> Ranker:
    """The ``kind`` ranker over ``index``: its saved one when still current, else built (and saved
    for the next start). Exact rankers, and IVF ones over too few rows, are simply made."""
    if kind not in APPROXIMATE or exact_fallback(kind, len(index)):
        return Ranker(index.blocks, kind)
    built_over = fingerprint(index.directory)
    ranker = load_ranker(index, kind, built_over)
    if ranker is None:
        ranker = Ranker(index.blocks, kind)
        save_ranker(ranker, index.directory, built_over)
    return ranker
