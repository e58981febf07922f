"""What a new user met with the MLLM methods in search, beyond the stores: a modification text holding
``*``, a gallery file deleted after indexing in a batch of queries, a negative with a ``+rerank``
method (CLI and page), and the wording of gallery errors."""

from __future__ import annotations

import json

import pytest

from toyworld.synthetic import ScriptedEngine
from demind.search.query import SearchError, SearchQuery

from test_search import one_torch_thread, write_image  # noqa: F401  (module fixtures)
from test_search_mllm import index_dir, loaded, search_cli, searcher_with, setup_with  # noqa: F401


def recording_engine() -> ScriptedEngine:
    """Answers every request "Target description: a photo of a heart" and keeps the prompts (``prompts``)."""
    return ScriptedEngine(lambda request: "Target description: a photo of a heart")


class KnowsNothing:
    """A verifier that scores every candidate alike (stands in for the MLLM's yes/no answer)."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def score(self, queries, candidates):
        self.asked.append([c.name for c in candidates[0]])
        return [[0.5 for _ in cands] for cands in candidates]


# ----------------------------------------------------------------------------- a '*' in the words


@pytest.mark.parametrize("method", ["osrcir", "cirevl"])
def test_a_star_in_the_modification_text_reaches_the_describer_whole(loaded, index_dir, method):  # noqa: F811
    engine = recording_engine()
    searcher = searcher_with(loaded, index_dir, setup_with(engine, store=None))
    text = "replace the * logo with a red heart"
    searcher.search(SearchQuery(image=searcher.index.path_of("img1.png"), text=text, method=method, k=3))
    assert any(text in prompt for prompt in engine.prompts), engine.prompts


# ----------------------------------------------------------------------------- a negative with +rerank


def test_a_negative_with_a_rerank_method_is_searched(loaded, index_dir):  # noqa: F811
    searcher = searcher_with(loaded, index_dir, setup_with(recording_engine(), rerank_k=3, store=None))
    verifier = KnowsNothing()
    searcher.mllm.run._verifier = verifier  # the MLLM verifier's place
    reference = searcher.index.path_of("img0.png")
    outcome = searcher.search_with_details(SearchQuery(image=reference, text="make it red", method="demind+rerank",
                                                       negative="the dog", k=5))
    assert outcome.method == "demind+deo+rerank" and outcome.text == "make it red, without the dog"
    assert outcome.negative == "the dog" and outcome.reranked == 3 and len(verifier.asked) == 1
    deo = searcher.search(SearchQuery(image=reference, text="make it red", method="demind", negative="the dog", k=5))
    assert verifier.asked[0] == [h.name for h in deo[:3]]  # the +deo ranking's top K is what was re-ranked
    assert [h.name for h in outcome.hits] == [h.name for h in deo]  # equal scores keep their order


def test_a_negative_with_rerank_on_the_command_line_and_the_page(tiny_checkpoint, index_dir, loaded, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    import demind.mllm.session as session

    monkeypatch.setattr(session.MLLMRun, "reranker", lambda self: __import__("demind.mllm.rerank", fromlist=[
        "Reranker"]).Reranker(KnowsNothing(), self.setup.rerank.k))
    import demind.engines as engines

    monkeypatch.setattr(engines, "build_engine", lambda *a, **k: recording_engine())
    out = tmp_path / "results.json"
    reference = str(index_dir.parent / "gallery" / "img3.png")
    assert search_cli(tiny_checkpoint, index_dir, "--image", reference, "--text", "make it red", "--method",
                      "demind+rerank", "--negative", "the dog", "engine.name=transformers",
                      "engine.model=scripted-model", "rerank.k=3", "--out", str(out)) == 0
    record = json.loads(out.read_text())["queries"][0]
    assert "error" not in record and record["method"] == "demind+deo+rerank" and record["negative"] == "the dog"
    assert record["reranked"] == 3 and len(record["results"]) == 9

    pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")
    from demind.search.server import create_app

    searcher = searcher_with(loaded, index_dir, setup_with(recording_engine(), rerank_k=3, store=None))
    answer = create_app(searcher).test_client().post("/api/search", data={
        "gallery_name": "img3.png", "text": "make it red", "method": "demind+rerank", "negative": "the dog"})
    assert answer.status_code == 200, answer.get_json()
    assert answer.get_json()["method"] == "demind+deo+rerank" and answer.get_json()["reranked"] == 3


def test_a_negative_with_a_method_that_cannot_take_one_is_refused_in_the_users_words(loaded, index_dir):  # noqa: F811
    searcher = searcher_with(loaded, index_dir, setup_with(recording_engine(), rerank_k=3, store=None))
    with pytest.raises(SearchError) as e:
        searcher.search(SearchQuery(image=searcher.index.path_of("img0.png"), text="make it red",
                                    method="image-only+rerank", negative="the dog"))
    assert "'image-only+rerank'" in str(e.value) and "+deo" not in str(e.value)


# ----------------------------------------------------------------------------- a gallery file gone


def test_a_gallery_file_deleted_after_indexing_fails_only_the_rerank_query_of_a_batch(tiny_checkpoint, index_dir,  # noqa: F811
                                                                                      tmp_path, monkeypatch, capsys):
    import demind.engines as engines

    monkeypatch.setattr(engines, "build_engine", lambda *a, **k: recording_engine())
    gallery = index_dir.parent / "gallery"
    reference = tmp_path / "my-ref.png"
    reference.write_bytes((gallery / "img0.png").read_bytes())
    for name in ("img1.png", "img2.png", "img3.png", "img4.png", "img5.png", "img6.png", "img7.png", "img8.png"):
        (gallery / name).unlink()  # every top-3 list of 10 images holds one of these now
    queries = tmp_path / "queries.jsonl"
    queries.write_text("\n".join(json.dumps(q) for q in [
        {"id": "plain", "image": str(reference), "text": "make it red"},
        {"id": "reranked", "image": str(reference), "text": "make it red", "method": "demind+rerank"},
        {"id": "words", "text": "a red square", "method": "text-only"}]) + "\n")
    out = tmp_path / "results.json"
    status = search_cli(tiny_checkpoint, index_dir, "--queries", str(queries), "--out", str(out),
                        "engine.name=transformers", "engine.model=scripted-model", "rerank.k=3")
    captured = capsys.readouterr()
    assert status == 1 and "Traceback" not in captured.err, captured.err[-2000:]
    records = {r["id"]: r for r in json.loads(out.read_text())["queries"]}
    assert len(records["plain"]["results"]) == 9 and len(records["words"]["results"]) == 10  # 9: the copy left out
    error = records["reranked"]["error"]
    assert "results" not in records["reranked"] and "\n" not in error
    assert "img" in error and "demind-index" in error and "remove it from the split" not in error


def test_index_and_search_speak_of_the_index_not_of_a_benchmark_split(loaded, tmp_path, capsys, caplog):  # noqa: F811
    from demind.search.index import build_index, load_index
    from demind.search.query import Searcher

    gallery = tmp_path / "photos"
    for i in range(3):
        write_image(gallery / f"img{i}.png", i, size=24)
    (gallery / "broken.png").write_bytes(b"\x89PNG not really")
    stats = build_index(gallery, tmp_path / "index", loaded[0], progress=False)
    assert "broken.png" in stats.unreadable
    why = stats.unreadable["broken.png"]
    assert "split" not in why and "fix or remove the file" in why
    searcher = Searcher(*loaded, load_index(tmp_path / "index"))
    (gallery / "img1.png").unlink()
    with pytest.raises(SearchError) as e:
        searcher.search(SearchQuery(image=searcher.index.image_ref("img1.png"), text="make it red"))
    assert "split" not in str(e.value) and "img1.png" in str(e.value)
    assert "split" not in caplog.text and "fix or remove the file" in caplog.text


# ----------------------------------------------------------------------------- demind-serve stopped

SERVE_WITH_A_SCRIPTED_ENGINE = '''
import sys
import demind.engines as engines
from toyworld.synthetic import ScriptedEngine

engines.build_engine = lambda *a, **k: ScriptedEngine(lambda request: "Target description: a red square")
from demind.cli.serve import main

sys.exit(main(sys.argv[1:]))
'''


def multipart(fields: dict[str, str], image: bytes) -> tuple[bytes, str]:
    boundary = "demind-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="ref.png"\r\n'
                 f'Content-Type: image/png\r\n\r\n'.encode() + image + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_serve_removes_uploaded_references_when_stopped(tiny_checkpoint, index_dir, tmp_path, stop):  # noqa: F811
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from helpers import REPO_ROOT

    script = tmp_path / "serve.py"
    script.write_text(SERVE_WITH_A_SCRIPTED_ENGINE)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), "--index", str(index_dir), "--checkpoint",
                             str(tiny_checkpoint), "--port", "0", "run.progress=false", "run.device=cpu",
                             "engine.name=transformers", "engine.model=scripted"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # started as a script's background job is: SIGINT inherited ignored (Python then
                            # installs no Ctrl-C handler of its own); the server must still stop on it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        address = None
        deadline = time.time() + 180
        while address is None and time.time() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            if line.startswith("demind search: "):
                address = line.split()[2]
        assert address, proc.stderr.read()[-2000:] if proc.poll() is not None else "no address printed"
        body, kind = multipart({"text": "make it red", "method": "osrcir", "k": "3"},
                               (index_dir.parent / "gallery" / "img2.png").read_bytes())
        request = urllib.request.Request(address + "api/search", data=body, headers={"Content-Type": kind})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert json.loads(answer.read())["description"] == "a red square"
        uploads = list(temp.glob("demind-search-uploads-*"))
        assert len(uploads) == 1 and list(uploads[0].glob("*.png"))  # the upload, as the describer read it
        proc.send_signal(getattr(signal, stop))
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 0, proc.stderr.read()[-2000:]
    assert list(temp.glob("demind-search-uploads-*")) == []
