"""demind-serve says which ranker ranks the gallery and what recall@10 to expect: the line it
prints at start, the same line in ``/api/info`` ("ranker_line"), and the page that shows it as text.
demind-serve runs as a function with waitress replaced, so nothing is actually served."""

from __future__ import annotations

import re
import threading

import pytest

pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")

from demind.search.expectations import expectation_line  # noqa: E402
from demind.search.index import build_index  # noqa: E402
from demind.search.server import page_html  # noqa: E402

from test_search import one_torch_thread, write_image  # noqa: E402,F401  (module fixtures)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, tiny_checkpoint):  # noqa: F811
    from demind.checkpoint import load_backbone_and_model

    root = tmp_path_factory.mktemp("ranker-line")
    for i in range(6):
        write_image(root / "gallery" / f"g{i}.png", i)
    backbone, _ = load_backbone_and_model(tiny_checkpoint)
    build_index(root / "gallery", root / "idx", backbone, batch_size=4, progress=False)
    return root / "idx"


def serve_without_serving(monkeypatch, argv: list[str]):
    """Run demind-serve's main with ``argv``; waitress is never started. Returns the searcher it
    built and its app."""
    import demind.search.server as server_module
    from demind.cli.serve import main as serve_main

    built = {}
    real_create_app = server_module.create_app

    def recording_create_app(searcher, problem=None, settings=None):
        built["searcher"] = searcher
        built["app"] = real_create_app(searcher, problem=problem, settings=settings)
        return built["app"]

    class Stopped:
        port = 8124

    def fake_start_server(app, host, port):  # return at once instead of blocking on a real server
        done = threading.Thread(target=lambda: None)
        done.start()
        return Stopped(), done

    monkeypatch.setattr(server_module, "create_app", recording_create_app)
    monkeypatch.setattr(server_module, "start_server", fake_start_server)
    monkeypatch.setattr(server_module.guard, "bind_problem", lambda host, port: None)  # no real socket
    assert serve_main(argv) == 0
    return built["searcher"], built["app"]


@pytest.mark.parametrize("kind", ["exact", "faiss-hnsw"])
def test_serve_prints_the_ranker_line_and_the_page_gets_the_same(kind, index_dir, tiny_checkpoint,  # noqa: F811
                                                                 monkeypatch, capsys):
    if kind != "exact":
        pytest.importorskip("faiss", reason="faiss-cpu not installed (optional extra 'search')")
    searcher, app = serve_without_serving(monkeypatch, ["--index", str(index_dir), "--checkpoint",
                                                        str(tiny_checkpoint), "--ranker", kind, "run.progress=false"])
    assert searcher.ranker.kind == kind
    out = capsys.readouterr().out.splitlines()
    line = expectation_line(searcher.expectation)
    assert line in out and out.index(line) < next(i for i, o in enumerate(out) if o.startswith("demind search: "))
    assert line.startswith(f"ranker {kind}: ")
    if kind == "exact":
        assert line == "ranker exact: exact search (every result is in the true top k)"
    else:  # the recall this ranker measured of itself as it was built, to three places
        recall = searcher.ranker.recall_at_10
        assert isinstance(recall, float) and 0 <= recall <= 1
        assert f"recall@10 {recall:.3f} against exact search" in line

    info = app.test_client().get("/api/info").get_json()
    assert info["ranker_line"] == line  # the page shows what the terminal showed
    assert info["ranker"] == searcher.expectation


def test_a_server_without_an_index_has_no_ranker_line():
    from demind.search.server import create_app

    info = create_app(None, problem="index X was built with backbone A").test_client().get("/api/info").get_json()
    assert "ranker_line" not in info and info["problem"]


def test_the_page_shows_the_ranker_line_as_text():
    page = page_html()
    element = re.search(r'<div id="ranker"[^>]*>', page)
    assert element and " hidden" in element.group(0)  # shown only once /api/info gave a line
    assert '$("ranker").textContent = info.ranker_line' in page
    assert '$("ranker").hidden = !info.ranker_line' in page
    # the line names a server-side index's ranker: never parsed as HTML
    assert not re.search(r'\$\("ranker"\)\.(innerHTML|outerHTML|insertAdjacentHTML)', page)
    assert 'getElementById("ranker").innerHTML' not in page
