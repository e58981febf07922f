"""Saved FAISS rankers (:mod:`demind.search.ranker_store`): a built ranker is saved in its index
folder and the next start of the same index loads it (not rebuilt: the build counter and the log
say so) with the same answers; a changed index, changed settings or a damaged file are one logged
line and a rebuild; demind-index --measure-rankers saves what it builds."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from demind.search import ranker_store, rankers
from demind.search.index import load_index
from demind.search.index_manifest import MANIFEST
from demind.search.ranker_store import fingerprint, open_ranker, saved_paths

from test_search_rankers import clustered, one_faiss_thread, synthetic_index  # noqa: F401  (fixture)

faiss = pytest.importorskip("faiss", reason="faiss-cpu not installed (optional extra 'search')")


@pytest.fixture
def builds(monkeypatch):
    """{kind: builds} counted at the FAISS builders the Ranker calls."""
    counts = {"faiss-hnsw": 0, "faiss-ivf": 0, "faiss-ivfpq": 0}
    for kind, name in (("faiss-hnsw", "build_hnsw_index"), ("faiss-ivf", "build_ivf_index"),
                       ("faiss-ivfpq", "build_ivfpq_index")):
        def counted(*args, _kind=kind, _build=getattr(rankers, name), **kwargs):
            counts[_kind] += 1
            return _build(*args, **kwargs)
        monkeypatch.setattr(rankers, name, counted)
    return counts


def store_lines(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "demind.search.ranker_store"]
    caplog.clear()
    return lines


KINDS = ("faiss-hnsw", "faiss-ivf", "faiss-ivfpq")


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_ranker_is_loaded_not_rebuilt_and_answers_the_same(tmp_path, builds, caplog, kind):
    index = synthetic_index(tmp_path, clustered(2000, 16, seed=1))
    queries = clustered(20, 16, seed=2)
    with caplog.at_level(logging.INFO):
        built = open_ranker(index, kind)
        assert builds[kind] == 1 and store_lines(caplog) == []  # nothing saved before: built, nothing to say
        faiss_path, record_path = saved_paths(tmp_path, kind)
        record = json.loads(record_path.read_text())
        assert record["settings"] == built.settings and record["recall_at_10"] == built.recall_at_10
        assert record["index"] == fingerprint(tmp_path) == {"parts": json.loads((tmp_path / MANIFEST).read_text())[
            "parts"], "embed_dim": 16, "dtype": "float16"} and record["file_bytes"] == faiss_path.stat().st_size

        loaded = open_ranker(load_index(tmp_path), kind)  # the next start of the same index
        assert builds[kind] == 1 and loaded.saved_at == faiss_path  # loaded, not built again
        (line,) = store_lines(caplog)
        assert line.startswith(f"{kind}: loaded the saved ranker {faiss_path} in ") and \
            f"recall@10 {built.recall_at_10:.3f} against exact search" in line
    assert loaded.settings == built.settings and loaded.recall_at_10 == built.recall_at_10
    assert loaded.build_s == round(built.build_s, 2)
    for a, b in zip(loaded.top_k(queries, 10), built.top_k(queries, 10)):
        assert torch.equal(a, b)  # the same rows and the same scores


def test_a_changed_index_rebuilds_and_saves_again(tmp_path, builds, caplog):
    index = synthetic_index(tmp_path, clustered(2000, 16, seed=1))
    open_ranker(index, "faiss-ivfpq")
    grown = synthetic_index(tmp_path, clustered(2400, 16, seed=1))  # other parts (as demind-index writes them)
    with caplog.at_level(logging.INFO):
        ranker = open_ranker(grown, "faiss-ivfpq")
        assert builds["faiss-ivfpq"] == 2 and ranker.size == 2400
        saved = saved_paths(tmp_path, "faiss-ivfpq")[0]
        assert store_lines(caplog) == [f"faiss-ivfpq: not reusing the saved ranker {saved}: the index changed since "
                                       "it was built (other parts); building it again"]
        open_ranker(load_index(tmp_path), "faiss-ivfpq")  # the rebuilt one was saved: loaded now
    assert builds["faiss-ivfpq"] == 2


def test_other_settings_rebuild(tmp_path, builds, caplog, monkeypatch):
    index = synthetic_index(tmp_path, clustered(2000, 16, seed=1))
    open_ranker(index, "faiss-ivf")
    monkeypatch.setattr(rankers, "IVF_NPROBE", 4)  # the code's setting changed since it was saved
    with caplog.at_level(logging.INFO):
        assert open_ranker(index, "faiss-ivf").settings["nprobe"] == 4 and builds["faiss-ivf"] == 2
    (line,) = store_lines(caplog)
    assert "its settings {'nlist': 51, 'nprobe': 16} are not the current {'nlist': 51, 'nprobe': 4}" in line


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage record", "missing file"])
def test_a_damaged_saved_ranker_is_one_line_and_a_rebuild(tmp_path, builds, caplog, damage):
    index = synthetic_index(tmp_path, clustered(2000, 16, seed=1))
    first = open_ranker(index, "faiss-ivfpq")
    faiss_path, record_path = saved_paths(tmp_path, "faiss-ivfpq")
    data = faiss_path.read_bytes()
    if damage == "truncated":
        faiss_path.write_bytes(data[:len(data) // 2])
    elif damage == "flipped":  # same size, one byte of the codes changed: only the checksum sees it
        faiss_path.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "garbage record":
        record_path.write_text("{not json")
    else:
        faiss_path.unlink()
    with caplog.at_level(logging.INFO):
        again = open_ranker(load_index(tmp_path), "faiss-ivfpq")
    (line,) = store_lines(caplog)
    assert line.startswith(f"faiss-ivfpq: not reusing the saved ranker {faiss_path}: ") and \
        line.endswith("; building it again")
    assert builds["faiss-ivfpq"] == 2 and again.saved_at is None and again.recall_at_10 == first.recall_at_10
    assert json.loads(record_path.read_text())["file_bytes"] == faiss_path.stat().st_size  # saved again, whole


def test_a_faiss_file_that_faiss_cannot_read_is_a_rebuild(tmp_path, builds, caplog):
    """A file whose record matches but whose bytes FAISS refuses (written by hand, another version)."""
    index = synthetic_index(tmp_path, clustered(2000, 16, seed=1))
    open_ranker(index, "faiss-ivf")
    faiss_path, record_path = saved_paths(tmp_path, "faiss-ivf")
    faiss_path.write_bytes(b"not a faiss index")
    record = json.loads(record_path.read_text())
    record.update(file_bytes=faiss_path.stat().st_size, sha256=ranker_store._sha256(faiss_path))
    record_path.write_text(json.dumps(record))
    with caplog.at_level(logging.INFO):
        open_ranker(load_index(tmp_path), "faiss-ivf")
    (line,) = store_lines(caplog)
    assert "it cannot be read (" in line and builds["faiss-ivf"] == 2


def test_exact_rankers_and_fallbacks_save_nothing(tmp_path, builds):
    index = synthetic_index(tmp_path, clustered(400, 16, seed=1))  # too few rows for IVF lists
    for kind in ("exact", "faiss-flat", "faiss-ivf", "faiss-ivfpq"):
        assert open_ranker(index, kind).faiss_index is None
    assert not (tmp_path / "rankers").exists() and builds == {"faiss-hnsw": 0, "faiss-ivf": 0, "faiss-ivfpq": 0}


def test_an_unwritable_index_folder_still_searches(tmp_path, builds, caplog, monkeypatch):
    index = synthetic_index(tmp_path, clustered(2000, 16, seed=1))
    (tmp_path / "rankers").write_text("a file where the folder goes")
    with caplog.at_level(logging.INFO):
        ranker = open_ranker(index, "faiss-ivf")
    (line,) = store_lines(caplog)
    assert line.startswith("faiss-ivf: could not save the built ranker in") and ranker.faiss_index is not None


def test_measure_rankers_saves_what_it_builds_and_the_next_start_loads_it(tmp_path, builds, caplog):
    from demind.search.expectations import describe, expectation, record_rankers

    index = synthetic_index(tmp_path, clustered(2000, 16, seed=1))
    record = record_rankers(index, True, {})
    assert builds == {"faiss-hnsw": 1, "faiss-ivf": 1, "faiss-ivfpq": 1}
    for kind in KINDS:
        assert record[kind]["saved"] == f"rankers/{kind}.faiss"
        assert describe(kind, record[kind]).endswith(f"; saved as rankers/{kind}.faiss)")
        saved = json.loads(saved_paths(tmp_path, kind)[1].read_text())
        assert saved["recall_at_10"] == record[kind]["recall_at_10"] and saved["settings"] == record[kind]["settings"]
        ranker = open_ranker(load_index(tmp_path), kind)  # what demind-search / demind-serve do at start
        said = expectation(ranker, load_index(tmp_path))
        assert said["recall_at_10"] == said["recorded_recall_at_10"] == record[kind]["recall_at_10"]
        assert said["source"] == f"measured on this index's rows as the saved ranker {kind}.faiss was built"
    assert builds == {"faiss-hnsw": 1, "faiss-ivf": 1, "faiss-ivfpq": 1}  # nothing built again


def test_saved_rankers_of_an_earlier_index_state_are_removed(tmp_path, builds, caplog):
    """After the index changed, its saved rankers can never load again: removed (with a line each);
    the current ones stay."""
    from demind.search.ranker_store import remove_stale_rankers

    index = synthetic_index(tmp_path, clustered(2000, 16, seed=1))
    for kind in ("faiss-ivf", "faiss-ivfpq"):
        open_ranker(index, kind)
    assert remove_stale_rankers(tmp_path) == []  # still current
    grown = synthetic_index(tmp_path, clustered(2400, 16, seed=1))
    open_ranker(grown, "faiss-ivf")  # rebuilt over the new parts: current again
    caplog.clear()  # its "not reusing" line, where an earlier test left the logger at INFO
    with caplog.at_level(logging.INFO):
        assert remove_stale_rankers(tmp_path) == ["faiss-ivfpq"]
    (line,) = store_lines(caplog)
    assert line.startswith(f"removed the saved ranker {saved_paths(tmp_path, 'faiss-ivfpq')[0]} (")
    assert not any(p.exists() for p in saved_paths(tmp_path, "faiss-ivfpq"))
    assert all(p.exists() for p in saved_paths(tmp_path, "faiss-ivf"))
    assert builds["faiss-ivf"] == 2 and open_ranker(load_index(tmp_path), "faiss-ivf").saved_at is not None


def test_a_saved_ranker_still_loads_after_the_index_folder_is_moved(tmp_path, builds):
    """The record names no path of this machine: an index copied elsewhere with its rankers/ folder
    loads its saved ranker there instead of building it again."""
    import shutil

    synthetic_index(tmp_path / "here", clustered(2000, 16, seed=1))
    built = open_ranker(load_index(tmp_path / "here"), "faiss-ivfpq")
    shutil.move(tmp_path / "here", tmp_path / "elsewhere")
    record = saved_paths(tmp_path / "elsewhere", "faiss-ivfpq")[1].read_text()
    assert str(tmp_path) not in record
    moved = open_ranker(load_index(tmp_path / "elsewhere"), "faiss-ivfpq")
    assert moved.saved_at == saved_paths(tmp_path / "elsewhere", "faiss-ivfpq")[0] and builds["faiss-ivfpq"] == 1
    queries = clustered(20, 16, seed=2)
    assert torch.equal(moved.top_k(queries, 10)[1], built.top_k(queries, 10)[1])
