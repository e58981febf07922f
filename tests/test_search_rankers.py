"""The approximate rankers and what each ranker is expected to give: faiss-ivf's and faiss-ivfpq's
recall against exact search on a clustered gallery (ivfpq's scores exact) and their exact fallback
on tiny ones; the record demind-index writes (``--measure-rankers``) and what demind-search and the
page's /api/info say about it. Saved rankers: tests/test_search_ranker_store.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from demind.search.expectations import describe, read_record, record_rankers
from demind.search.index import load_index
from demind.search.index_manifest import MANIFEST
from demind.search.rankers import (IVF_NPROBE, IVFPQ_NPROBE, Ranker, build_ivfpq_index,
                                   default_settings, exact_top_k, ivf_lists, ivfpq_shortlist, pq_bits,
                                   pq_subquantizers, resident_bytes)

from test_search import gallery, loaded, one_torch_thread  # noqa: F401  (fixtures)

faiss = pytest.importorskip("faiss", reason="faiss-cpu not installed (optional extra 'search')")


@pytest.fixture(autouse=True)
def one_faiss_thread():
    """One FAISS thread: the HNSW graph (and so its recall) is then the same on every build."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


def clustered(n: int, dim: int, seed: int, clusters: int = 40) -> torch.Tensor:
    """(n, dim) L2-normalised rows around ``clusters`` centres shared by every seed (CLIP-like: a
    common direction, clusters, per-row noise)."""
    base = torch.Generator().manual_seed(123)
    shared, centres = F.normalize(torch.randn(dim, generator=base), dim=0), F.normalize(
        torch.randn(clusters, dim, generator=base), dim=-1)
    g = torch.Generator().manual_seed(seed)
    rows = 0.6 * shared + 0.6 * centres[torch.randint(0, clusters, (n,), generator=g)]
    return F.normalize(rows + 0.5 * torch.randn(n, dim, generator=g) / dim ** 0.5, dim=-1)


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    return sum(len(set(a) & set(b)) for a, b in zip(found.tolist(), truth.tolist())) / truth.numel()


def test_ivf_reaches_the_stated_recall_on_a_clustered_gallery():
    rows = clustered(6000, 64, seed=0).half()
    blocks = [rows[:2500], rows[2500:]]  # the index's form: float16 blocks
    queries = clustered(100, 64, seed=1)
    ivf = Ranker(blocks, "faiss-ivf")
    assert ivf.settings == {"nlist": ivf_lists(6000), "nprobe": IVF_NPROBE} and ivf.fallback is None
    assert ivf_lists(6000) == min(round(4 * 6000 ** 0.5), 6000 // 39) == 153
    _, truth = exact_top_k(blocks, queries, 10)
    scores, found = ivf.top_k(queries, 10)
    assert recall(found, truth) >= 0.95
    # the scores are the stored float16 rows' own: equal to exact search's for the rows it found
    assert torch.allclose(scores, torch.einsum("bd,bkd->bk", queries, rows.float()[found]), atol=1e-3)
    # what it reports of itself: recall@10 on queries made of the gallery (midpoints of two rows)
    g = torch.Generator().manual_seed(0)
    pick = torch.randint(0, 6000, (100, 2), generator=g)
    mid = F.normalize(rows[pick[:, 0]].float() + rows[pick[:, 1]].float(), dim=-1)
    assert ivf.recall_at_10 == recall(ivf.top_k(mid, 10)[1], exact_top_k(blocks, mid, 10)[1])
    assert 0.9 <= ivf.recall_at_10 <= 1 and ivf.build_s > 0


def test_ivf_on_a_tiny_gallery_searches_exactly_in_one_logged_line(caplog):
    rows = clustered(300, 16, seed=2)
    with caplog.at_level(logging.INFO, logger="demind.search.rankers"):
        ivf = Ranker(rows, "faiss-ivf")
    lines = [r.getMessage() for r in caplog.records if r.name == "demind.search.rankers"]
    assert lines == ["faiss-ivf over 300 rows: 300 rows are fewer than 16 lists of 39 training rows; searching "
                     "exactly instead (the same top k, recall 1)"]
    queries = clustered(5, 16, seed=3)
    assert torch.equal(ivf.top_k(queries, 10)[1], Ranker(rows).top_k(queries, 10)[1])
    assert ivf.faiss_index is None and ivf.recall_at_10 == 1.0


def test_ivfpq_returns_exact_scores_and_reaches_the_stated_recall_on_a_clustered_gallery():
    rows = clustered(6000, 64, seed=0).half()
    blocks = [rows[:2500], rows[2500:]]
    queries = clustered(100, 64, seed=1)
    pq = Ranker(blocks, "faiss-ivfpq")
    nlist = ivf_lists(6000)
    # 64 / 8 = 8 sub-quantizers; 6000 training rows give 2^7 centroids FAISS's 39 rows each
    assert pq.settings == {"nlist": nlist, "nprobe": IVFPQ_NPROBE, "m": 8, "nbits": 7, "shortlist": 100}
    assert pq.settings == default_settings("faiss-ivfpq", 6000, 64) and pq.fallback is None
    held = resident_bytes(pq.faiss_index)  # 8 codes of 7 bits = 7 bytes a row, and an 8-byte id
    assert held == {"codes": 6000 * 7, "ids": 6000 * 8}
    _, truth = exact_top_k(blocks, queries, 10)
    scores, found = pq.top_k(queries, 10)
    assert recall(found, truth) >= 0.95
    # exact scores: each returned row's float32 product with the query (its stored float16 row)
    assert torch.allclose(scores, torch.einsum("bd,bkd->bk", queries, rows.float()[found]), atol=1e-6, rtol=0)
    assert torch.all(scores[:, :-1] >= scores[:, 1:])  # best first
    # the codes' own (approximate) scores are not what it returns: the shortlist was rescored
    codes_only = torch.from_numpy(pq.faiss_index.search(queries.numpy(), 10)[0])
    assert (codes_only - scores).abs().max() > 1e-3
    assert 0.9 <= pq.recall_at_10 <= 1 and pq.build_s > 0


def test_ivfpq_takes_a_divisor_of_the_width_fewer_bits_on_few_rows_and_a_shortlist_growing_with_rows():
    assert [ivfpq_shortlist(n) for n in (6000, 100_000, 10 ** 6, 10 ** 7)] == [100, 253, 800, 2530]
    assert [pq_subquantizers(d) for d in (512, 768, 64, 100, 17)] == [64, 96, 8, 10, 1]
    assert [pq_bits(n) for n in (100, 624, 5000, 9984, 10 ** 6)] == [4, 4, 7, 8, 8]
    rows = clustered(2000, 20, seed=5)  # 20 is not a multiple of 8: 2 sub-quantizers of 10 dims
    index = build_ivfpq_index([rows])
    assert index.pq.M == 2 and index.pq.nbits == 5 and index.ntotal == 2000


def test_ivfpq_on_a_tiny_gallery_searches_exactly_in_one_logged_line(caplog):
    rows = clustered(300, 16, seed=2)
    with caplog.at_level(logging.INFO, logger="demind.search.rankers"):
        pq = Ranker(rows, "faiss-ivfpq")
    lines = [r.getMessage() for r in caplog.records if r.name == "demind.search.rankers"]
    assert lines == ["faiss-ivfpq over 300 rows: 300 rows are fewer than 16 lists of 39 training rows; searching "
                     "exactly instead (the same top k, recall 1)"]
    queries = clustered(5, 16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(pq.top_k(queries, 10), Ranker(rows).top_k(queries, 10)))
    assert pq.faiss_index is None and pq.recall_at_10 == 1.0 and pq.settings == {}


def test_ivfpq_with_fewer_candidates_than_k_in_its_lists_answers_exactly():
    rows = clustered(2000, 16, seed=6)
    pq = Ranker(rows, "faiss-ivfpq")
    pq.faiss_index.nprobe, pq.shortlist = 1, 0  # one list of ~2000 / nlist rows, asked for 200
    queries = clustered(3, 16, seed=7)
    scores, found = pq.top_k(queries, 200)
    truth_scores, truth = exact_top_k([rows], queries, 200)
    assert torch.equal(found, truth) and torch.allclose(scores, truth_scores)


def synthetic_index(folder, rows: torch.Tensor):
    """An index folder in demind-index's layout holding ``rows`` (two parts)."""
    from demind.retrieval import ImageFeatureCache
    from demind.search.index import ROLE
    from demind.search.index_manifest import INDEX_FORMAT

    cache = ImageFeatureCache.at(folder, dtype=torch.float16, normalise=True)
    parts, names = [], []
    for first in (0, len(rows) // 2):
        chunk = rows[first:first + len(rows) // 2]
        chunk_names = [f"img{i}.jpg" for i in range(first, first + len(chunk))]
        record = cache.write_part(ROLE, chunk_names, chunk_names, cache.stored(chunk), {"name": "synthetic"})
        parts.append([record.stem, len(chunk)])
        names += chunk_names
    (folder / MANIFEST).write_text(json.dumps({
        "format": INDEX_FORMAT, "root": str(folder), "backbone": {"name": "synthetic"}, "backbone_slug": "s",
        "precision": "fp32", "embed_dim": rows.shape[1], "dtype": "float16", "parts": parts, "images": names,
        "members": {}, "unreadable": {}}))
    return load_index(folder)


def test_the_ranker_record_holds_each_rankers_measurement_and_is_dropped_when_stale(tmp_path):
    index = synthetic_index(tmp_path, clustered(3000, 32, seed=4, clusters=400))
    record = record_rankers(index, True, {})
    assert record["exact"] == record["faiss-flat"] == {"recall_at_10": "exact"}
    for kind in ("faiss-hnsw", "faiss-ivf", "faiss-ivfpq"):
        entry = record[kind]
        again = Ranker(index.blocks, kind)  # the same build (one thread, seeded k-means): the same measurement
        assert 0 <= entry["recall_at_10"] <= 1 and entry["recall_at_10"] == again.recall_at_10
        assert entry["settings"] == again.settings and entry["rows"] == 3000 and entry["build_s"] >= 0
    assert record["faiss-ivf"]["recall_at_10"] < 1  # a measurement, not a constant
    assert read_record(tmp_path) == record  # written into index.json
    assert describe("faiss-ivf", record["faiss-ivf"]).startswith(
        f"faiss-ivf: recall@10 {record['faiss-ivf']['recall_at_10']:.3f} against exact search (measured on this "
        f"index's 3000 rows; built in")
    assert record_rankers(index, False, record) == record  # a rerun on the same parts keeps it
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["parts"] = manifest["parts"][:1]  # other parts: the measurement is of another index
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    stale = record_rankers(index, False, record)
    assert stale["faiss-hnsw"] == stale["faiss-ivf"] == stale["faiss-ivfpq"] == {"recall_at_10": None}
    assert describe("faiss-hnsw", stale["faiss-hnsw"]) == ("faiss-hnsw: not measured (demind-index "
                                                          "--measure-rankers measures it on this index)")


def test_index_prints_the_rankers_and_search_and_the_page_say_which_and_what_recall(
        gallery, tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    from demind.cli.index import main as index_main
    from demind.cli.search import main as search_main

    common = ["--images", str(gallery), "--index", str(tmp_path / "idx"), "--checkpoint", str(tiny_checkpoint),
              "run.progress=false", "--num-workers", "0"]
    assert index_main(common) == 0
    out = capsys.readouterr().out
    assert f"rankers on this index (recorded in {tmp_path / 'idx'}/index.json):\n  exact: exact top k\n" \
           "  faiss-flat: exact top k\n  faiss-hnsw: not measured (demind-index --measure-rankers" in out
    assert index_main([*common, "--measure-rankers"]) == 0
    out = capsys.readouterr().out
    record = read_record(tmp_path / "idx")
    hnsw = record["faiss-hnsw"]
    assert 0 <= hnsw["recall_at_10"] <= 1 and hnsw["rows"] == 7
    assert "  " + describe("faiss-hnsw", hnsw) + "\n" in out
    for kind in ("faiss-ivf", "faiss-ivfpq"):
        assert (f"  {kind}: exact top k (searches exactly: 7 rows are fewer than 16 lists of 39 training rows)"
                in out and record[kind] == {"recall_at_10": "exact", "fallback": "7 rows are fewer than 16 "
                                                                                "lists of 39 training rows"})
    assert sorted(p.name for p in (tmp_path / "idx" / "rankers").iterdir()) == ["faiss-hnsw.faiss", "faiss-hnsw.json"]
    assert index_main(common) == 0 and read_record(tmp_path / "idx") == record  # kept: the same parts
    assert "  " + describe("faiss-hnsw", hnsw) + "\n" in capsys.readouterr().out

    query = ["--index", str(tmp_path / "idx"), "--checkpoint", str(tiny_checkpoint), "--image",
             str(gallery / "img2.png"), "--text", "make it red", "-k", "3"]
    assert search_main([*query, "--out", str(tmp_path / "exact.json")]) == 0
    assert capsys.readouterr().out.startswith("ranker exact: exact search (every result is in the true top k)\n")
    assert json.loads((tmp_path / "exact.json").read_text())["ranker_expectation"] == {
        "ranker": "exact", "recall_at_10": "exact", "source": "exact search"}
    assert search_main([*query, "--ranker", "faiss-hnsw", "--out", str(tmp_path / "hnsw.json")]) == 0
    said = json.loads((tmp_path / "hnsw.json").read_text())["ranker_expectation"]
    assert said["ranker"] == "faiss-hnsw" and said["recorded_recall_at_10"] == hnsw["recall_at_10"]
    assert 0 <= said["recall_at_10"] <= 1
    assert capsys.readouterr().out.startswith(
        f"ranker faiss-hnsw: expect recall@10 {said['recall_at_10']:.3f} against exact search (measured on this "
        f"index's rows as the saved ranker faiss-hnsw.faiss was built; demind-index recorded "
        f"{hnsw['recall_at_10']:.3f})\n")  # the one demind-index built and saved, loaded


def test_the_page_says_which_ranker_and_what_recall(gallery, tmp_path, loaded):  # noqa: F811
    pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")
    from demind.search.index import build_index
    from demind.search.query import Searcher
    from demind.search.server import create_app

    backbone, model = loaded
    build_index(gallery, tmp_path / "idx", backbone, batch_size=4, progress=False)
    for kind in ("exact", "faiss-hnsw"):
        searcher = Searcher(backbone, model, load_index(tmp_path / "idx"), kind)
        info = create_app(searcher).test_client().get("/api/info").get_json()
        assert info["ranker"] == searcher.expectation and info["ranker"]["ranker"] == kind
        expected = "exact" if kind == "exact" else searcher.ranker.recall_at_10
        assert info["ranker"]["recall_at_10"] == expected


def test_hnsw_search_width_grows_with_the_gallery():
    """efSearch: 128 up to 100,000 rows, then 128 per 100,000 (1,280 at 1M: 1,024 was the smallest
    measured to keep recall@10 above 0.95 on queries between clusters); a built ranker uses it."""
    pytest.importorskip("faiss", reason="faiss-cpu not installed (optional extra 'search')")
    from demind.search.rankers import default_settings, hnsw_ef_search

    assert [hnsw_ef_search(n) for n in (7, 100_000, 250_000, 1_000_000)] == [128, 128, 320, 1280]
    assert default_settings("faiss-hnsw", 1_000_000, 512)["efSearch"] == 1280
    rows = torch.nn.functional.normalize(torch.randn(300, 8), dim=-1)
    ranker = Ranker(rows, "faiss-hnsw")
    assert ranker.settings["efSearch"] == ranker.faiss_index.hnsw.efSearch == 128


def test_ivfpq_asks_the_os_for_no_read_ahead_on_its_mapped_rows(tmp_path, monkeypatch):
    """faiss-ivfpq reads a shortlist of scattered rows a query: built or loaded, it advises its blocks'
    mappings as randomly read (after the build's own scans); exact and the other rankers do not."""
    import demind.search.rankers as rankers_module
    from demind.search.ranker_store import open_ranker

    advised = []
    monkeypatch.setattr(rankers_module, "advise_random_access", lambda block: advised.append(block) or True)
    synthetic_index(tmp_path, clustered(2000, 32, seed=0))
    index = load_index(tmp_path)
    for kind in ("exact", "faiss-ivf"):
        Ranker(index.blocks, kind)
    assert advised == []
    built = open_ranker(index, "faiss-ivfpq")  # built, then saved
    assert [b.data_ptr() for b in advised] == [b.data_ptr() for b in index.blocks] and built.saved_at is None
    advised.clear()
    loaded = open_ranker(load_index(tmp_path), "faiss-ivfpq")
    assert loaded.saved_at is not None and len(advised) == len(loaded.blocks) == 2
    queries = clustered(20, 32, seed=3)
    assert torch.equal(built.top_k(queries, 10)[1], loaded.top_k(queries, 10)[1])
