"""What each ranker gives on one index, recorded in its ``index.json`` under ``"rankers"``.

``exact`` and ``faiss-flat`` return the exact top k ("exact"). The approximate rankers
(``faiss-hnsw``, ``faiss-ivf``, ``faiss-ivfpq``) are measured only when asked (``demind-index
--measure-rankers``: building them is costly): their build time and recall@10 against exact search
on queries made of this index's own rows (:meth:`demind.search.rankers.Ranker.measured_recall`);
what is built is saved in the index folder (:mod:`demind.search.ranker_store`), so the next
search or serve start loads it instead of building it. A measurement is kept by later runs while
the index's parts and the ranker's settings are those it was measured on; any other is dropped
(stale), never shown.
"""

from __future__ import annotations

import logging
from pathlib import Path

from demind.errors import InputError
from demind.io import read_json, write_json_atomic
from demind.search.index import GalleryIndex
from demind.search.index_manifest import MANIFEST
from demind.search.ranker_store import save_ranker
from demind.search.rankers import APPROXIMATE, KINDS, Ranker, default_settings, exact_fallback

log = logging.getLogger(__name__)

RECORD_KEY = "rankers"
EXACT = "exact"


def _manifest(index_dir: str | Path) -> dict:
    """The index's ``index.json`` as read; {} when it is missing or not a JSON object (the index's
    own reader names such problems: this record is only ever extra)."""
    try:
        manifest = read_json(Path(index_dir) / MANIFEST, fix="")
    except (InputError, OSError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def read_record(index_dir: str | Path) -> dict:
    """The ``"rankers"`` record of the index at ``index_dir``; {} when there is none (or no index)."""
    record = _manifest(index_dir).get(RECORD_KEY)
    return record if isinstance(record, dict) else {}


def _width(index: GalleryIndex) -> int:
    return index.blocks[0].shape[1] if index.blocks else 0


def _current(entry: object, kind: str, parts: list, rows: int, dim: int) -> bool:
    """Whether a recorded measurement is of these parts with this ranker's settings."""
    return (isinstance(entry, dict) and entry.get("parts") == parts and isinstance(entry.get("recall_at_10"), float)
            and entry.get("settings") == default_settings(kind, rows, dim))


def measure(index: GalleryIndex, kind: str, parts: list) -> dict:
    """Build ``kind`` over the index's rows and save it in the index folder (the next search or
    serve start loads it); its record: recall@10 (against exact search), build seconds, settings,
    the parts measured (or why it searches exactly)."""
    ranker = Ranker(index.blocks, kind)
    if ranker.fallback:
        return {"recall_at_10": EXACT, "fallback": ranker.fallback}
    saved = save_ranker(ranker, index.directory)
    entry = {"recall_at_10": ranker.recall_at_10, "build_s": round(ranker.build_s, 2), "settings": ranker.settings,
             "rows": ranker.size, "parts": parts}
    if saved is not None:  # where the next start loads it from (relative to the index folder)
        entry["saved"] = saved.with_suffix(".faiss").relative_to(index.directory).as_posix()
    return entry


def record_rankers(index: GalleryIndex, measure_approximate: bool, previous: dict) -> dict:
    """{kind: entry} of every ranker on ``index``, written into its ``index.json`` and returned:
    "exact" for the exact ones; for the approximate ones a fresh measurement when
    ``measure_approximate``, else ``previous``'s when still current, else ``{"recall_at_10": None}``
    (faiss-ivf and faiss-ivfpq on a gallery too small for them: "exact", with the reason)."""
    path = index.directory / MANIFEST
    manifest = read_json(path, fix="rerun demind-index")
    parts, rows, record = manifest.get("parts"), len(index), {}
    for kind in KINDS:
        if kind not in APPROXIMATE:
            record[kind] = {"recall_at_10": EXACT}
        elif exact_fallback(kind, rows):  # known without building anything
            record[kind] = {"recall_at_10": EXACT, "fallback": exact_fallback(kind, rows)}
        elif measure_approximate:
            record[kind] = measure(index, kind, parts)
        elif _current(previous.get(kind), kind, parts, rows, _width(index)):
            record[kind] = previous[kind]
        else:
            record[kind] = {"recall_at_10": None}
    manifest[RECORD_KEY] = record
    write_json_atomic(path, manifest)
    return record


def describe(kind: str, entry: dict | None) -> str:
    """One line of what ``kind`` gives, from its record ``entry``."""
    entry = entry or {}
    recall = entry.get("recall_at_10")
    if recall == EXACT:
        return f"{kind}: exact top k" + (f" (searches exactly: {entry['fallback']})" if entry.get("fallback") else "")
    if isinstance(recall, float):
        settings = ", ".join(f"{k} {v}" for k, v in entry.get("settings", {}).items())
        saved = f"; saved as {entry['saved']}" if entry.get("saved") else ""
        return (f"{kind}: recall@10 {recall:.3f} against exact search (measured on this index's {entry.get('rows')} "
                f"rows; built in {entry.get('build_s')} s; {settings}{saved})")
    return f"{kind}: not measured (demind-index --measure-rankers measures it on this index)"


def expectation(ranker: Ranker, index: GalleryIndex) -> dict:
    """What a search with ``ranker`` over ``index`` gives: {"ranker", "recall_at_10": "exact" or the
    fraction, "source"}. An approximate ranker measured itself when it was built (the same
    measurement as ``demind-index --measure-rankers``; a saved one loaded: when it was built and
    saved); the index's record is named beside it."""
    if ranker.kind not in APPROXIMATE or ranker.fallback:
        return {"ranker": ranker.kind, "recall_at_10": EXACT, "source": ranker.fallback or "exact search"}
    manifest = _manifest(index.directory)
    recorded = (manifest.get(RECORD_KEY) or {}).get(ranker.kind) if isinstance(manifest.get(RECORD_KEY), dict) else None
    recorded = recorded if _current(recorded, ranker.kind, manifest.get("parts"), len(index), _width(index)) else None
    source = "measured on this index's rows as the ranker was built"
    if ranker.saved_at is not None:
        source = f"measured on this index's rows as the saved ranker {ranker.saved_at.name} was built"
    return {"ranker": ranker.kind, "recall_at_10": ranker.recall_at_10, "source": source,
            "recorded_recall_at_10": recorded["recall_at_10"] if recorded else None}


def expectation_line(found: dict) -> str:
    """The one line the search commands print about their ranker."""
    if found["recall_at_10"] == EXACT:
        if found["source"] == "exact search":
            return f"ranker {found['ranker']}: exact search (every result is in the true top k)"
        return (f"ranker {found['ranker']}: exact search here, {found['source']} (every result is in the "
                f"true top k)")
    recorded = found.get("recorded_recall_at_10")
    return (f"ranker {found['ranker']}: expect recall@10 {found['recall_at_10']:.3f} against exact search "
            f"({found['source']}" + (f"; demind-index recorded {recorded:.3f})" if recorded is not None else ")"))
