"""Gallery index and composed search: build, incremental update, resume after a kill, corrupt
files, ranking against an oracle, FAISS == exact, bad inputs, and the command lines."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from demind.search.index import build_index, load_index
from demind.search.index_manifest import GalleryIndexError
from demind.search.query import SearchError, Searcher, SearchQuery
from demind.search.rankers import Ranker


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One thread: on the shared 2-core machine OpenMP threads only spin against other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def same_rows(a, b, atol: float = 1e-3) -> bool:
    """Two indexes hold the same names with the same rows (within float16 rounding), in any row order
    (an index keeps its parts' order: a resumed or repaired build appends the re-encoded part)."""
    rows_b = dict(zip(b.names, b.features))
    return sorted(a.names) == sorted(b.names) and all(
        torch.allclose(row, rows_b[name], atol=atol) for name, row in zip(a.names, a.features))


def write_image(path: Path, seed: int, size: int = 16) -> Path:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    from demind.checkpoint import load_backbone_and_model

    return load_backbone_and_model(tiny_checkpoint)


@pytest.fixture()
def gallery(tmp_path) -> Path:
    for i in range(6):
        write_image(tmp_path / "gallery" / f"img{i}.png", i)
    write_image(tmp_path / "gallery" / "sub" / "deep.jpg", 99)
    (tmp_path / "gallery" / "notes.txt").write_text("not an image")
    return tmp_path / "gallery"


def build(gallery: Path, index: Path, backbone, **kw):
    return build_index(gallery, index, backbone, batch_size=2, part_size=3, progress=False, **kw)


def test_index_holds_every_image_and_matches_direct_encoding(gallery, tmp_path, loaded):
    backbone, _ = loaded
    stats = build(gallery, tmp_path / "index", backbone)
    assert stats.as_dict() | {"seconds": 0, "encoded_per_s": 0} == {
        "images": 7, "indexed": 7, "cached": 0, "encoded": 7, "removed": 0, "unreadable": 0,
        "seconds": 0, "encoded_per_s": 0}
    index = load_index(tmp_path / "index")
    assert index.names == [f"img{i}.png" for i in range(6)] + ["sub/deep.jpg"]
    with torch.no_grad():
        pixels = backbone.preprocess(Image.open(gallery / "sub" / "deep.jpg").convert("RGB")).unsqueeze(0)
        direct = torch.nn.functional.normalize(backbone.encode_image(pixels), dim=-1)[0]
    # stored as float16 (BENCHMARKS.md: rankings unchanged): equal within its rounding
    assert index.blocks[0].dtype == torch.float16
    assert torch.allclose(index.features[6], direct, atol=5e-4)
    assert torch.allclose(index.features.norm(dim=-1), torch.ones(7), atol=1e-3)


def test_rerun_encodes_only_new_and_changed_files_and_drops_removed_ones(gallery, tmp_path, loaded):
    backbone, _ = loaded
    build(gallery, tmp_path / "index", backbone)
    before = load_index(tmp_path / "index")

    write_image(gallery / "new.png", 50)                    # added
    write_image(gallery / "img1.png", 51)                   # changed content (size equal, mtime differs)
    os.utime(gallery / "img1.png", ns=(1, 1_000_000_000))
    (gallery / "img2.png").unlink()                         # removed
    stats = build(gallery, tmp_path / "index", backbone)
    assert (stats.encoded, stats.cached, stats.removed, stats.indexed) == (2, 5, 1, 7)

    after = load_index(tmp_path / "index")
    assert "img2.png" not in after.names and "new.png" in after.names
    row = {n: i for i, n in enumerate(after.names)}
    old_row = {n: i for i, n in enumerate(before.names)}
    assert torch.equal(after.features[row["img0.png"]], before.features[old_row["img0.png"]])
    assert not torch.allclose(after.features[row["img1.png"]], before.features[old_row["img1.png"]])
    # compaction: the parts hold exactly the live entries
    stored = sum(len(json.loads(p.read_text())["names"]) for p in (tmp_path / "index" / "embeddings").glob("part-*.json"))
    assert stored == 7 and not list((tmp_path / "index" / "embeddings").glob("part-*.pt"))
    assert build(gallery, tmp_path / "index", backbone).encoded == 0  # nothing changed: nothing encoded


def test_a_killed_build_resumes_from_its_finished_parts(gallery, tmp_path, loaded, monkeypatch):
    backbone, _ = loaded
    import demind.retrieval.cache as image_cache

    real, calls = image_cache._encode_chunk, []

    def dies_on_second_part(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(image_cache, "_encode_chunk", dies_on_second_part)
    with pytest.raises(KeyboardInterrupt):
        build(gallery, tmp_path / "index", backbone)
    assert not (tmp_path / "index" / "index.json").exists()  # unfinished: not loadable ...
    with pytest.raises(GalleryIndexError, match="unfinished build"):
        load_index(tmp_path / "index")
    monkeypatch.setattr(image_cache, "_encode_chunk", real)
    stats = build(gallery, tmp_path / "index", backbone)   # ... until the rerun finishes it
    assert (stats.cached, stats.encoded, stats.indexed) == (3, 4, 7)
    fresh = build(gallery, tmp_path / "fresh", backbone)
    assert fresh.encoded == 7
    assert same_rows(load_index(tmp_path / "index"), load_index(tmp_path / "fresh"))


def test_corrupt_images_are_skipped_counted_and_not_retried_until_changed(gallery, tmp_path, loaded):
    backbone, _ = loaded
    (gallery / "broken.jpg").write_bytes(b"not a jpeg")
    stats = build(gallery, tmp_path / "index", backbone)
    assert (stats.indexed, len(stats.unreadable)) == (7, 1)
    assert "broken.jpg" in stats.unreadable["broken.jpg"]
    assert "broken.jpg" not in load_index(tmp_path / "index").names
    again = build(gallery, tmp_path / "index", backbone)
    assert (again.encoded, len(again.unreadable)) == (0, 1)   # still counted, not re-decoded
    write_image(gallery / "broken.jpg", 7)                     # repaired
    fixed = build(gallery, tmp_path / "index", backbone)
    assert (fixed.encoded, len(fixed.unreadable), fixed.indexed) == (1, 0, 8)


def test_an_index_of_another_backbone_is_refused_naming_both(gallery, tmp_path, loaded, tiny_backbone):
    backbone, model = loaded
    build(gallery, tmp_path / "index", tiny_backbone)  # random-init backbone: another identity
    with pytest.raises(GalleryIndexError, match="was made with backbone .* but this run uses .*differs in pretrained"):
        build(gallery, tmp_path / "index", backbone)
    with pytest.raises(GalleryIndexError, match="was made with backbone .*checkpoint's backbone differs"):
        Searcher(backbone, model, load_index(tmp_path / "index"))


def oracle_searcher(features: torch.Tensor, names: list[str], loaded, ranker: str = "exact") -> Searcher:
    """A searcher over a hand-made index, so the expected ranking is known exactly."""
    from demind.retrieval import backbone_cache_slug
    from demind.search.index import GalleryIndex

    backbone, model = loaded
    index = GalleryIndex(Path("oracle"), Path("/gallery"), names, torch.nn.functional.normalize(features, dim=-1),
                         backbone.identity, backbone_cache_slug(backbone), backbone.cfg.precision)
    return Searcher(backbone, model, index, ranker)


def test_results_are_ranked_by_cosine_with_the_query(tmp_path, loaded):
    backbone, model = loaded
    ref = write_image(tmp_path / "ref.png", 3)
    searcher = oracle_searcher(torch.randn(4, backbone.embed_dim), ["a", "b", "c", "d"], loaded)
    q = searcher.embed(SearchQuery(image=ref, text="make it red"))
    # an oracle gallery: scores 0.9, -0.5, 0.2 and 1.0 with the query, by construction
    orth = torch.randn(4, backbone.embed_dim)
    orth -= (orth @ q[0])[:, None] * q[0]
    orth = torch.nn.functional.normalize(orth, dim=-1)
    cos = torch.tensor([0.9, -0.5, 0.2, 1.0])
    gallery = cos[:, None] * q[0] + (1 - cos[:, None] ** 2).clamp(min=0).sqrt() * orth
    searcher = oracle_searcher(gallery, ["a", "b", "c", "d"], loaded)
    hits = searcher.search(SearchQuery(image=ref, text="make it red", k=3))
    assert [h.name for h in hits] == ["d", "a", "c"]
    assert [h.score for h in hits] == pytest.approx([1.0, 0.9, 0.2], abs=1e-5)
    excluded = searcher.search(SearchQuery(image=ref, text="make it red", k=3, exclude="d"))
    assert [h.name for h in excluded] == ["a", "c", "b"]


def test_faiss_flat_equals_exact_and_hnsw_recalls_it(loaded):
    pytest.importorskip("faiss", reason="faiss-cpu not installed (optional extra 'search')")
    generator = torch.Generator().manual_seed(0)
    gallery = torch.nn.functional.normalize(torch.randn(2000, 32, generator=generator), dim=-1)
    queries = torch.nn.functional.normalize(torch.randn(50, 32, generator=generator), dim=-1)
    exact_scores, exact_rows = Ranker(gallery, "exact").top_k(queries, 10)
    flat_scores, flat_rows = Ranker(gallery, "faiss-flat").top_k(queries, 10)
    assert torch.equal(flat_rows, exact_rows)
    assert torch.allclose(flat_scores, exact_scores, atol=1e-5)
    hnsw = Ranker(gallery, "faiss-hnsw")
    _, hnsw_rows = hnsw.top_k(queries, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(hnsw_rows.tolist(), exact_rows.tolist())])
    assert recall >= 0.9
    assert 0.9 <= hnsw.recall_at_10 <= 1 and hnsw.build_s > 0  # what the search commands log
    # the index's form: float16 rows in several memory-mapped blocks; exact and faiss-flat rank them as
    # the float32 product of the same values does, one query at a time or batched
    blocks = [gallery[:700].half(), gallery[700:].half()]
    scores16, rows16 = Ranker(blocks, "exact").top_k(queries, 10)
    one_by_one = torch.cat([Ranker(blocks, "exact").top_k(q[None], 10)[1] for q in queries])
    truth_scores, truth_rows = torch.topk(queries @ torch.cat(blocks).float().T, 10)
    assert torch.equal(rows16, truth_rows) and torch.equal(one_by_one, truth_rows)
    assert torch.allclose(scores16, truth_scores, atol=1e-6)
    assert torch.equal(Ranker(blocks, "faiss-flat").top_k(queries, 10)[1], truth_rows)


def test_every_method_searches_the_real_index(gallery, tmp_path, loaded):
    backbone, model = loaded
    build(gallery, tmp_path / "index", backbone)
    searcher = Searcher(backbone, model, load_index(tmp_path / "index"))
    assert searcher.available_methods()[0] == "demind"
    ref = gallery / "img3.png"
    for method in searcher.available_methods():
        hits = searcher.search(SearchQuery(image=ref, text="make it red", method=method, k=4))
        assert len(hits) == 4 and [h.rank for h in hits] == [1, 2, 3, 4]
        assert [h.score for h in hits] == sorted([h.score for h in hits], reverse=True)
    # image-only finds the reference itself first unless it is excluded
    assert searcher.search(SearchQuery(image=ref, text="", method="image-only", k=1))[0].name == "img3.png"
    name = searcher.gallery_name_of(ref)
    assert name == "img3.png"
    assert searcher.search(SearchQuery(image=ref, text="x", method="image-only", k=1, exclude=name))[0].name != name
    # the demind query equals the model's documented inference API
    with torch.no_grad():
        v = backbone.encode_image(backbone.preprocess(Image.open(ref).convert("RGB")).unsqueeze(0))
        expected = model.query(v, ["make it red"])
    assert torch.allclose(searcher.embed(SearchQuery(image=ref, text="make it red")), expected, atol=1e-5)


@pytest.mark.parametrize("query, message", [
    (dict(text="   "), "modification text is empty"),
    (dict(image=b"garbage bytes", text="red"), "uploaded reference image cannot be read"),
    (dict(image="missing.png", text="red"), "does not exist"),
    (dict(text="red", method="nope"), "unknown method"),
    (dict(text="red", template="a photo of {text}"), "needs one"),
    (dict(image=None, text="red"), "needs a reference image"),
    (dict(text="red", method="image-only", negative="the dog"), "reads no text"),
])
def test_bad_queries_get_one_clear_message(query, message, tmp_path, loaded):
    backbone, _ = loaded
    ref = write_image(tmp_path / "ref.png", 1)
    (tmp_path / "broken.png").write_bytes(b"broken")
    searcher = oracle_searcher(torch.randn(3, backbone.embed_dim), ["a", "b", "c"], loaded)
    with pytest.raises(SearchError, match=message):
        searcher.search(SearchQuery(**({"image": ref} | query)))
    with pytest.raises(SearchError, match="broken.png"):
        searcher.search(SearchQuery(image=tmp_path / "broken.png", text="red"))


def test_a_negative_is_searched_as_deo_with_the_negation_in_the_text(tmp_path, loaded):
    """--negative "the dog" on "make it red" == the +deo method on "make it red, without the dog"."""
    backbone, _ = loaded
    ref = write_image(tmp_path / "ref.png", 1)
    searcher = oracle_searcher(torch.randn(3, backbone.embed_dim), ["a", "b", "c"], loaded)
    with_negative = searcher.embed(SearchQuery(image=ref, text="make it red", negative=" the  dog "))
    as_deo = searcher.embed(SearchQuery(image=ref, text="make it red, without the dog", method="demind+deo"))
    plain = searcher.embed(SearchQuery(image=ref, text="make it red"))
    assert torch.equal(with_negative, as_deo)
    assert not torch.allclose(with_negative, plain, atol=1e-4)  # the negative moved the query


def test_index_and_search_commands_end_to_end(gallery, tmp_path, tiny_checkpoint, capsys):
    from demind.cli.index import main as index_main
    from demind.cli.search import main as search_main

    (gallery / "broken.png").write_bytes(b"broken")
    assert index_main(["--images", str(gallery), "--index", str(tmp_path / "idx"), "--checkpoint",
                       str(tiny_checkpoint), "run.progress=false", "--num-workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "7 images (7 encoded" in out and "1 unreadable" in out and "broken.png" in out

    ref = gallery / "img2.png"
    assert search_main(["--index", str(tmp_path / "idx"), "--checkpoint", str(tiny_checkpoint), "--image", str(ref),
                        "--text", "make it red", "-k", "3", "--out", str(tmp_path / "one.json")]) == 0
    record = json.loads((tmp_path / "one.json").read_text())["queries"][0]
    assert record["excluded"] == "img2.png" and len(record["results"]) == 3
    assert "img2.png" not in [h["name"] for h in record["results"]]
    printed = capsys.readouterr().out
    assert all(h["name"] in printed for h in record["results"])

    queries = tmp_path / "q.jsonl"
    queries.write_text("\n".join(json.dumps(q) for q in [
        {"id": "a", "image": str(ref), "text": "make it red", "k": 2},
        {"id": "b", "text": "a red square", "method": "text-only"},
        {"id": "c", "image": str(gallery / "broken.png"), "text": "red"},
    ]))
    assert search_main(["--index", str(tmp_path / "idx"), "--checkpoint", str(tiny_checkpoint),
                        "--queries", str(queries), "--out", str(tmp_path / "many.json")]) == 1  # one query failed
    records = {r["id"]: r for r in json.loads((tmp_path / "many.json").read_text())["queries"]}
    assert records["a"]["results"] == record["results"][:2]  # the same query gives the same answer
    assert len(records["b"]["results"]) == 7
    assert "broken.png" in records["c"]["error"]


def test_commands_turn_bad_input_into_one_line(gallery, tmp_path, tiny_checkpoint, tiny_backbone, capsys):
    from demind.cli.search import main as search_main
    from demind.search.index import build_index

    common = ["--checkpoint", str(tiny_checkpoint)]
    assert search_main(["--index", str(tmp_path / "none"), *common, "--text", "red", "--image",
                        str(gallery / "img0.png")]) == 2
    assert "no index at" in capsys.readouterr().err
    assert search_main(["--index", str(tmp_path / "none"), *common, "--text", "red", "--image", "x.png"]) == 2
    err = capsys.readouterr().err  # a missing reference image: refused with the config, naming its flag
    assert err.count("error:") == 1 and "'x.png': no such file" in err and "--image" in err
    build_index(gallery, tmp_path / "other", tiny_backbone, progress=False)  # another backbone
    assert search_main(["--index", str(tmp_path / "other"), *common, "--text", "red", "--image",
                        str(gallery / "img0.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: index") and "checkpoint's backbone" in err and "Traceback" not in err
    (tmp_path / "empty.jsonl").write_text("\n")
    assert search_main(["--index", str(tmp_path / "other"), *common, "--queries", str(tmp_path / "empty.jsonl")]) == 2
    assert "empty.jsonl holds no queries" in capsys.readouterr().err


def test_a_negative_is_recorded_as_it_was_searched(gallery, tmp_path, tiny_checkpoint, capsys):
    """--negative runs demind+deo on "TEXT, without NEGATIVE": the results JSON says so."""
    from demind.cli.index import main as index_main
    from demind.cli.search import main as search_main

    common = ["--index", str(tmp_path / "idx"), "--checkpoint", str(tiny_checkpoint)]
    assert index_main(["--images", str(gallery), *common[:2], *common[2:], "run.progress=false",
                       "--num-workers", "0"]) == 0
    ref = str(gallery / "img2.png")
    assert search_main([*common, "--image", ref, "--text", "make it blue", "--negative", "the circle",
                        "--out", str(tmp_path / "neg.json")]) == 0
    assert search_main([*common, "--image", ref, "--text", "make it blue, without the circle", "--method",
                        "demind+deo", "--out", str(tmp_path / "deo.json")]) == 0
    neg = json.loads((tmp_path / "neg.json").read_text())["queries"][0]
    deo = json.loads((tmp_path / "deo.json").read_text())["queries"][0]
    assert neg["method"] == "demind+deo" and neg["text"] == "make it blue, without the circle"
    assert neg["negative"] == "the circle" and neg["results"] == deo["results"]


def test_bad_query_lines_are_counted_skips_naming_file_line_and_key(gallery, tmp_path, tiny_checkpoint, capsys,
                                                                   caplog):
    from demind.cli.index import main as index_main
    from demind.cli.search import main as search_main

    common = ["--index", str(tmp_path / "idx"), "--checkpoint", str(tiny_checkpoint)]
    assert index_main(["--images", str(gallery), *common, "run.progress=false", "--num-workers", "0"]) == 0
    ref = str(gallery / "img2.png")
    lines = [json.dumps({"id": "good", "image": ref, "text": "make it red"}),
             json.dumps({"image": ref, "text": None}), json.dumps({"image": 5, "text": "red"}),
             json.dumps({"image": ref, "text": "red", "negative": 7}),
             json.dumps({"image": ref, "text": "red", "k": "many"}), "{not json", json.dumps([1, 2]),
             json.dumps({"image": ref, "text": "red", "k": True})]
    queries = tmp_path / "q.jsonl"
    queries.write_text("\n".join(lines) + "\n")
    assert search_main([*common, "--queries", str(queries), "--out", str(tmp_path / "r.json")]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    records = json.loads((tmp_path / "r.json").read_text())["queries"]
    assert len(records) == 8 and len(records[0]["results"]) == 6  # the reference is left out
    errors = {r["line"]: r["error"] for r in records[1:]}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 8]
    expected = {2: "key 'text' must be a string, got null", 3: "key 'image' must be a string or null, got 5",
                4: "key 'negative' must be a string or null, got 7", 5: "key 'k' must be an integer, got \"many\"",
                6: "not JSON", 7: "expected an object", 8: "key 'k' must be an integer, got true"}
    for line, text in expected.items():
        assert f"{queries}:{line}" in errors[line] and text in errors[line], errors[line]
        assert f"{queries}:{line}" in captured.out
    assert "7 line(s) of the query file skipped" in caplog.text


def test_the_search_manifest_round_trips_relative_paths_and_names_what_to_run(tmp_path):
    from demind.search.run_manifest import SearchManifestError, read_search_manifest, write_search_manifest

    with pytest.raises(FileNotFoundError, match="run the quickstart first"):
        read_search_manifest(tmp_path)
    checkpoint = tmp_path / "train" / "b" / "demind-seed0" / "demind.safetensors"
    path = write_search_manifest(tmp_path, checkpoint, tmp_path / "benchmarks" / "cirr" / "dev",
                                 tmp_path / "search-index")
    assert json.loads(path.read_text())["checkpoint"] == "train/b/demind-seed0/demind.safetensors"  # relative
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    tmp_path.rename(moved)  # a moved run folder still serves
    paths = read_search_manifest(moved)
    assert paths == {"checkpoint": moved / "train" / "b" / "demind-seed0" / "demind.safetensors",
                     "images": moved / "benchmarks" / "cirr" / "dev", "index": moved / "search-index"}
    (moved / "search.json").write_text("{not json")
    with pytest.raises(SearchManifestError, match="search.json.*rerun the quickstart"):
        read_search_manifest(moved)


def write_shard(path: Path, members: dict[str, bytes]) -> Path:
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_image_members_of_tar_shards_are_indexed_in_place(gallery, tmp_path, loaded):
    import gzip

    backbone, model = loaded
    loose = {f"k{i}.png": write_image(tmp_path / "src" / f"k{i}.png", 70 + i).read_bytes() for i in range(3)}
    write_shard(gallery / "shards" / "00000.tar",
                {**loose, "k0.txt": b"a caption", "k9.jpg": b"not a jpeg"})
    (gallery / "shards" / "00001.tar").write_bytes(gzip.compress(b"compressed shards have no byte spans"))
    stats = build(gallery, tmp_path / "index", backbone)
    assert (stats.indexed, sorted(stats.unreadable)) == (10, ["shards/00000.tar/k9.jpg", "shards/00001.tar"])
    index = load_index(tmp_path / "index")
    member = "shards/00000.tar/k1.png"
    assert member in index.names and "shards/00000.tar/k0.txt" not in index.names
    with torch.no_grad():  # the member's feature is that of the same image as a file
        pixels = backbone.preprocess(Image.open(tmp_path / "src" / "k1.png").convert("RGB")).unsqueeze(0)
        direct = torch.nn.functional.normalize(backbone.encode_image(pixels), dim=-1)[0]
    assert torch.allclose(index.features[index.names.index(member)], direct, atol=5e-4)  # float16 rows
    # a member can be the reference (picked from the gallery) and is read in place
    searcher = Searcher(backbone, model, index)
    hit = searcher.search(SearchQuery(image=index.image_ref(member), text="", method="image-only", k=1))[0]
    assert hit.name == member and hit.score == pytest.approx(1.0, abs=1e-3)  # float16 rows
    # touching the shard re-encodes its members only
    os.utime(gallery / "shards" / "00000.tar", ns=(1, 2_000_000_000))
    again = build(gallery, tmp_path / "index", backbone)
    assert (again.encoded, again.cached) == (3, 7)


def test_links_that_lead_nowhere_are_counted_and_skipped(gallery, tmp_path, loaded):
    backbone, _ = loaded
    os.symlink(tmp_path / "absent.png", gallery / "dangling.png")
    os.symlink(gallery / "loop.jpg", gallery / "loop.jpg")  # a link to itself: ELOOP
    stats = build(gallery, tmp_path / "idx", backbone)
    assert stats.indexed == 7 and set(stats.unreadable) == {"dangling.png", "loop.jpg"}
    assert "dangling.png" in stats.unreadable["dangling.png"]
    manifest = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert set(manifest["unreadable"]) == {"dangling.png", "loop.jpg"}


def test_index_output_and_part_size_are_checked_first(gallery, tmp_path, tiny_checkpoint, capsys):
    from demind.cli.index import main as index_main

    (tmp_path / "afile").write_text("x")
    common = ["--images", str(gallery), "--checkpoint", str(tiny_checkpoint), "run.progress=false"]
    assert index_main([*common, "--index", str(tmp_path / "afile" / "idx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "afile" in err and "not a folder" in err
    assert index_main([*common, "--index", str(tmp_path / "idx"), "--part-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "part_size" in err
    with pytest.raises(GalleryIndexError, match="part_size must be at least 1"):
        build_index(gallery, tmp_path / "idx", None, part_size=0)


def test_following_another_folder_needs_the_explicit_flag(gallery, tmp_path, loaded, tiny_checkpoint, capsys):
    from demind.cli.index import main as index_main

    backbone, _ = loaded
    build(gallery, tmp_path / "idx", backbone)
    other = tmp_path / "other"
    write_image(other / "x.png", 50)
    with pytest.raises(GalleryIndexError, match="--new-folder"):
        build(other, tmp_path / "idx", backbone)
    assert len(load_index(tmp_path / "idx")) == 7  # untouched
    common = ["--images", str(other), "--index", str(tmp_path / "idx"), "--checkpoint", str(tiny_checkpoint),
              "run.progress=false", "--num-workers", "0"]
    assert index_main(common) == 2 and "drops the 7 indexed file(s)" in capsys.readouterr().err
    assert index_main([*common, "--new-folder"]) == 0
    assert load_index(tmp_path / "idx").names == ["x.png"]


def test_a_truncated_part_is_named_by_search_and_repaired_by_index(gallery, tmp_path, loaded):
    backbone, _ = loaded
    build(gallery, tmp_path / "idx", backbone)
    part = sorted((tmp_path / "idx" / "embeddings").glob("part-*.safetensors"))[0]
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(GalleryIndexError, match=f"{part.name} is truncated or corrupted.*rerun demind-index"):
        load_index(tmp_path / "idx")
    stats = build(gallery, tmp_path / "idx", backbone)
    assert stats.encoded == 3 and stats.cached == 4  # only the damaged part's images again
    fresh = build(gallery, tmp_path / "fresh", backbone)
    assert fresh.encoded == 7
    assert same_rows(load_index(tmp_path / "idx"), load_index(tmp_path / "fresh"))


DAMAGED_MANIFESTS = [
    ('{"format": "demind-index/1", "root', "is not valid JSON .*rerun demind-index"),
    ('{"format": "demind-index/1", "root": "/x", "backbone_slug": "s", "precision": "fp32", "embed_dim": 4, '
     '"images": {}, "unreadable": {}}', "key 'images' must be a JSON list.*rerun demind-index"),
    ('{"format": "demind-index/2", "root": "/x", "backbone_slug": "s", "precision": "fp32", "embed_dim": 4, '
     '"dtype": "float16", "parts": [["part-00000", 2]], "images": ["a"], "unreadable": {}}',
     "'images' \\(names\\) and 'parts' .* do not match.*rerun demind-index"),
]


@pytest.mark.parametrize("content, message", DAMAGED_MANIFESTS)
def test_a_damaged_index_json_is_named_by_search_and_rebuilt_by_index(gallery, tmp_path, loaded, content, message,
                                                                       caplog):
    """The advice search gives (rerun demind-index) works: the rerun rebuilds the manifest, reusing
    every stored embedding, and the index equals a fresh build."""
    backbone, _ = loaded
    build(gallery, tmp_path / "idx", backbone)
    (tmp_path / "idx" / "index.json").write_text(content)
    with pytest.raises(GalleryIndexError, match=message):
        load_index(tmp_path / "idx")
    with caplog.at_level(logging.WARNING):
        stats = build(gallery, tmp_path / "idx", backbone)
    assert "index.json" in caplog.text and "rebuilding the index" in caplog.text
    assert stats.encoded == 0 and stats.cached == 7
    build(gallery, tmp_path / "fresh", backbone)
    rebuilt, fresh = load_index(tmp_path / "idx"), load_index(tmp_path / "fresh")
    assert rebuilt.names == fresh.names and torch.equal(rebuilt.features, fresh.features)


def test_an_index_json_that_is_not_a_demind_index_is_left_alone(gallery, tmp_path, loaded):
    backbone, _ = loaded
    folder = tmp_path / "idx"
    folder.mkdir()
    (folder / "index.json").write_text("[1, 2, 3]")
    for act in (lambda: load_index(folder), lambda: build(gallery, folder, backbone)):
        with pytest.raises(GalleryIndexError, match=r"not a demind index \(a JSON list.*choose another --index"):
            act()
    assert (folder / "index.json").read_text() == "[1, 2, 3]"


def test_run_threads_is_applied_before_the_command_runs(gallery, tmp_path, tiny_checkpoint, monkeypatch):
    """``run.threads`` (search, index, eval, serve): torch's thread count is set before any model code runs."""
    import demind.search.index as index_module
    from demind.cli.index import main as index_main

    seen, real = [], index_module.build_index
    monkeypatch.setattr(index_module, "build_index", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])
    before = torch.get_num_threads()
    try:
        assert index_main(["--images", str(gallery), "--index", str(tmp_path / "idx"), "--checkpoint",
                           str(tiny_checkpoint), "run.progress=false", "--num-workers", "0", "run.threads=2"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [2] and before == 1
