"""An index emptied by its gallery (every image removed, then demind-index again): its rankers build
nothing and claim no recall, demind-index and demind-search say it holds no images, and a query is
refused in one line."""

from __future__ import annotations

import pytest

from test_search import one_torch_thread, write_image  # noqa: F401  (module fixtures)

pytest.importorskip("faiss", reason="faiss-cpu not installed (optional extra 'search')")


def test_an_emptied_index_builds_no_ranker_and_claims_no_recall(tiny_checkpoint, tmp_path, capsys):  # noqa: F811
    from demind.cli.index import main as index_main
    from demind.cli.search import main as search_main

    gallery, index = tmp_path / "photos", tmp_path / "index"
    for i in range(4):
        write_image(gallery / f"img{i}.png", i, size=24)
    args = ["--images", str(gallery), "--index", str(index), "--checkpoint", str(tiny_checkpoint), "--num-workers",
            "0", "run.progress=false"]
    assert index_main(args) == 0
    for path in gallery.iterdir():
        path.unlink()
    capsys.readouterr()
    assert index_main([*args, "--measure-rankers"]) == 0
    out = capsys.readouterr().out
    assert "0 images" in out and "recall@10" not in out and "0 rows" not in out
    assert "holds no images" in out
    assert not list(index.glob("rankers/*.faiss"))  # nothing built over 0 rows, nothing saved
    status = search_main(["--index", str(index), "--checkpoint", str(tiny_checkpoint), "--text", "make it red",
                          "--ranker", "faiss-hnsw", "run.progress=false"])
    captured = capsys.readouterr()
    assert "recall@10" not in captured.out and "holds no images" in captured.out + captured.err
    assert status == 1 and "Traceback" not in captured.err
    assert not list(index.glob("rankers/*.faiss"))
