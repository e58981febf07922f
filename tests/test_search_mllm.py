"""The MLLM methods (cirevl, osrcir, demind+mllm) and METHOD+rerank in search: a scripted engine behind the
Engine interface through the Searcher, demind-search and the page's API; the descriptions stored and reused
by query; refused in one line without an engine; the description shown as text on the page; and one search
with the tiny random LLaVA-NeXT through the transformers engine."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from demind.mllm import DescribeOptions, MLLMSetup, RerankOptions
from demind.errors import DemindError
from demind.search.index import build_index, load_index
from demind.search.query import SearchError, Searcher, SearchQuery

from toyworld import synthetic
from test_search import one_torch_thread, write_image  # noqa: F401  (module fixtures)

DESCRIPTIONS = ["a red circle on a white table", "two blue squares in the snow", "a green triangle beside a lamp",
                "three yellow stars over a dark sea", "an orange cat asleep on a sofa"]
PAYLOAD = 'a cat on a sofa <img src=x onerror="document.title=\'pwned\'"> <b>bold</b>'


class ScriptedEngine(synthetic.ScriptedEngine):
    """A request whose prompt holds a key of ``answers`` (a modification text) is answered
    "Target description: VALUE"; any other (CIReVL's caption) ``default``."""

    def __init__(self, answers: dict[str, str], default: str = "a photo of something"):
        super().__init__(self.lookup)
        self.answers, self.default = answers, default

    def lookup(self, request) -> str:
        found = [v for k, v in self.answers.items() if k in request.prompt]
        return f"Target description: {found[0]}" if found else self.default


def setup_with(engine, loads: list | None = None, rerank_k: int = 0, **describe) -> MLLMSetup:
    def factory():
        if loads is not None:
            loads.append(1)
        return engine
    return MLLMSetup(factory, model="scripted-model", engine_name="scripted", describe=DescribeOptions(**describe),
                     rerank=RerankOptions(k=rerank_k))


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):  # noqa: F811
    from demind.checkpoint import load_backbone_and_model

    return load_backbone_and_model(tiny_checkpoint)


@pytest.fixture()
def index_dir(tmp_path, loaded) -> Path:
    for i in range(10):
        write_image(tmp_path / "gallery" / f"img{i}.png", i, size=24)
    build_index(tmp_path / "gallery", tmp_path / "index", loaded[0], batch_size=5, progress=False)
    return tmp_path / "index"


def searcher_with(loaded, index_dir, mllm=None) -> Searcher:
    backbone, model = loaded
    return Searcher(backbone, model, load_index(index_dir), mllm=mllm)


def pick_description(plain: Searcher, modification: str) -> tuple[str, str]:
    """A description whose text-only top hit (the "target") differs from the modification text's own."""
    def top(text: str) -> str:
        return plain.search(SearchQuery(image=None, text=text, method="text-only", k=1))[0].name

    for d in DESCRIPTIONS:
        if top(d) != top(modification):
            return d, top(d)
    raise AssertionError("every description ranks the modification text's top hit first")


def test_the_described_target_ranks_first_and_the_description_is_stored_by_query(loaded, index_dir):
    plain = searcher_with(loaded, index_dir)
    modification = "make it look like winter"
    description, target = pick_description(plain, modification)
    engine, loads = ScriptedEngine({modification: description}), []
    searcher = searcher_with(loaded, index_dir, setup_with(engine, loads))
    reference = searcher.index.path_of("img3.png")
    query = SearchQuery(image=reference, text=modification, method="osrcir", k=5)
    outcome = searcher.search_with_details(query)
    assert outcome.description == description and outcome.hits[0].name == target
    # the description's text embedding, exactly: the hits and scores of a text-only search of it
    as_text = plain.search(SearchQuery(image=None, text=description, method="text-only", k=5))
    assert [(h.name, h.score) for h in outcome.hits] == [(h.name, h.score) for h in as_text]
    assert loads == [1] and engine.requests == 1
    # cirevl: a caption (the default answer) then the rewrite: the same description, the same ranking
    cirevl = searcher.search_with_details(SearchQuery(image=reference, text=modification, method="cirevl", k=5))
    assert cirevl.description == description and [h.name for h in cirevl.hits] == [h.name for h in as_text]
    assert engine.requests == 3 and loads == [1]  # the model is built once per process
    # asked again (whitespace differs, the same words): the store answers, not the model
    again = searcher.search_with_details(SearchQuery(image=reference, text=f"  {modification} ", method="osrcir",
                                                     k=5))
    assert again.hits == outcome.hits and engine.requests == 3
    # a new process (a new Searcher) reads the stored descriptions from the index's folder, loading no model
    stored = list((index_dir / "descriptions").rglob("part-*.json"))
    assert stored and any(description in p.read_text() for p in stored)
    fresh_loads: list = []
    fresh = searcher_with(loaded, index_dir, setup_with(ScriptedEngine({}), fresh_loads))
    assert fresh.search_with_details(query).hits == outcome.hits and fresh_loads == []
    assert fresh.mllm.summary()["loaded"] is False
    # the same image uploaded as bytes is the same query (keyed by pixels and words)
    upload = fresh.search_with_details(SearchQuery(image=Path(reference).read_bytes(), text=modification,
                                                   method="osrcir", k=5))
    assert upload.description == description and fresh_loads == []


def test_the_hybrid_mixes_demind_and_the_description(loaded, index_dir):
    modification = "make it look like winter"
    engine = ScriptedEngine({modification: DESCRIPTIONS[0]})
    reference = str(index_dir.parent / "gallery" / "img4.png")

    def hits(method: str, weight: float):
        searcher = searcher_with(loaded, index_dir, setup_with(engine, hybrid_weight=weight, store=None))
        return [(h.name, round(h.score, 4)) for h in searcher.search(
            SearchQuery(image=reference, text=modification, method=method, k=10))]

    assert hits("demind+mllm", 0.0) == hits("demind", 0.0)
    assert hits("demind+mllm", 1.0) == hits("osrcir", 1.0)
    assert hits("demind+mllm", 0.5) not in (hits("demind", 0.0), hits("osrcir", 1.0))
    assert hits("demind+mllm+deo", 0.5) == hits("demind+mllm", 0.5)  # no negation in the words: DEO keeps e_o


class KnowsTheTarget:
    """A verifier that scores ``target`` 1 and every other candidate 0."""

    def __init__(self, target: str):
        self.target, self.asked = target, []

    def score(self, queries, candidates):
        self.asked.append([c.name for c in candidates[0]])
        return [[1.0 if c.name == self.target else 0.0 for c in cands] for cands in candidates]


def test_rerank_puts_the_verified_target_first_and_keeps_the_rest(loaded, index_dir):
    searcher = searcher_with(loaded, index_dir, setup_with(ScriptedEngine({}), rerank_k=4))
    reference = searcher.index.path_of("img0.png")
    base = searcher.search(SearchQuery(image=reference, text="make it red", method="demind", k=8))
    target = base[3].name
    verifier = KnowsTheTarget(target)
    searcher.mllm.run._verifier = verifier  # the MLLM verifier's place: the scripted one knows the target
    assert "demind+rerank" in searcher.available_methods()
    outcome = searcher.search_with_details(SearchQuery(image=reference, text="make it red",
                                                       method="demind+rerank", k=8))
    names = [h.name for h in outcome.hits]
    assert verifier.asked == [[h.name for h in base[:4]]]  # the top K, nothing else
    assert names == [target] + [h.name for h in base[:3]] + [h.name for h in base[4:]]
    assert outcome.reranked == 4 and outcome.hits[0].score == base[3].score  # each keeps its own score
    assert [h.rank for h in outcome.hits] == list(range(1, 9))


def test_without_an_engine_the_methods_are_not_offered_and_refused_in_one_line(loaded, index_dir):
    searcher = searcher_with(loaded, index_dir)
    assert not {"cirevl", "osrcir", "demind+mllm"} & set(searcher.available_methods())
    assert not any(m.endswith("+rerank") for m in searcher.available_methods())
    for method in ("osrcir", "cirevl", "demind+mllm", "demind+rerank"):
        with pytest.raises(SearchError) as e:
            searcher.search(SearchQuery(image=searcher.index.path_of("img0.png"), text="make it red", method=method))
        assert "\n" not in str(e.value) and "engine.model=" in str(e.value)
    with_mllm = searcher_with(loaded, index_dir, setup_with(ScriptedEngine({})))
    assert {"cirevl", "osrcir", "demind+mllm"} <= set(with_mllm.available_methods())
    assert not any(m.endswith("+rerank") for m in with_mllm.available_methods())  # rerank.k = 0


# ----------------------------------------------------------------------------- demind-search

def search_cli(tiny_checkpoint, index_dir, *extra):  # noqa: F811
    from demind.cli.search import main

    return main(["--index", str(index_dir), "--checkpoint", str(tiny_checkpoint), "run.progress=false", *extra])


def test_demind_search_with_a_scripted_engine(tiny_checkpoint, index_dir, loaded, tmp_path, monkeypatch, capsys):  # noqa: F811
    import demind.engines as engines

    modification = "make it look like winter"
    description, target = pick_description(searcher_with(loaded, index_dir), modification)
    built = []

    def build_engine(cfg, sampling, device=None, seed=0):
        built.append(cfg.model)
        return ScriptedEngine({modification: description})

    monkeypatch.setattr(engines, "build_engine", build_engine)
    out = tmp_path / "results.json"
    picked = "img3.png" if target != "img3.png" else "img4.png"  # the reference itself is left out
    reference = str(index_dir.parent / "gallery" / picked)
    assert search_cli(tiny_checkpoint, index_dir, "--image", reference, "--text", modification, "--method", "osrcir",
                      "engine.name=transformers", "engine.model=scripted-model", "--out", str(out)) == 0
    record = json.loads(out.read_text())["queries"][0]
    assert record["description"] == description and record["results"][0]["name"] == target
    assert record["excluded"] == picked and built == ["scripted-model"]
    assert f"MLLM description: {description!r}" in capsys.readouterr().out
    # a second run: the description is read from the index's store, no engine is built
    assert search_cli(tiny_checkpoint, index_dir, "--image", reference, "--text", modification, "--method", "osrcir",
                      "engine.name=transformers", "engine.model=scripted-model", "--out", str(out)) == 0
    written = json.loads(out.read_text())
    assert built == ["scripted-model"] and written["queries"][0]["results"] == record["results"]
    assert written["mllm"] == {"model": "scripted-model", "engine": "transformers", "rerank_k": 0, "loaded": False}


@pytest.mark.parametrize("extra, message", [
    (["--method", "osrcir"], "method 'osrcir' runs a multimodal LLM: give engine.name=transformers engine.model="),
    (["--method", "demind", "rerank.k=5"], "rerank.k re-ranks with a multimodal LLM: give engine.name="),
])
def test_demind_search_without_an_engine_refuses_in_one_line(tiny_checkpoint, index_dir, capsys, extra,  # noqa: F811
                                                              message):
    reference = str(index_dir.parent / "gallery" / "img3.png")
    assert search_cli(tiny_checkpoint, index_dir, "--image", reference, "--text", "make it red", *extra) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and message in err[0]


# ----------------------------------------------------------------------------- the page and its API

def test_the_api_lists_and_answers_the_mllm_methods_only_with_an_engine(loaded, index_dir):
    pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")
    from demind.search.server import create_app

    modification = "make it look like winter"
    plain = searcher_with(loaded, index_dir)
    description, target = pick_description(plain, modification)
    client = create_app(plain).test_client()
    info = client.get("/api/info").get_json()
    assert info["mllm"] is None and not {"cirevl", "osrcir", "demind+mllm"} & {m["name"] for m in info["methods"]}
    refused = client.post("/api/search", data={"gallery_name": "img3.png", "text": modification, "method": "osrcir"})
    assert refused.status_code == 400 and "engine.model=" in refused.get_json()["error"]
    assert "\n" not in refused.get_json()["error"]

    searcher = searcher_with(loaded, index_dir, setup_with(ScriptedEngine({modification: description}),
                                                           rerank_k=3))
    client = create_app(searcher).test_client()
    picked = "img3.png" if target != "img3.png" else "img4.png"  # the reference itself is left out
    info = client.get("/api/info").get_json()
    names = [m["name"] for m in info["methods"]]
    assert {"cirevl", "osrcir", "demind+mllm", "osrcir+rerank"} <= set(names) and names[0] == "demind"
    assert info["mllm"] == {"model": "scripted-model", "engine": "scripted", "rerank_k": 3, "loaded": False}
    labels = {m["name"]: m["label"] for m in info["methods"]}
    assert labels["osrcir+rerank"] == "OSrCIR (MLLM reflective CoT) + MLLM re-rank"
    data = client.post("/api/search", data={"gallery_name": picked, "text": modification, "method": "osrcir",
                                            "k": "5"}).get_json()
    assert data["description"] == description and data["results"][0]["name"] == target
    assert picked not in [r["name"] for r in data["results"]]
    assert client.get("/api/info").get_json()["mllm"]["loaded"] is True
    demind = client.post("/api/search", data={"gallery_name": "img3.png", "text": "x", "method": "demind"}).get_json()
    assert demind["description"] is None and demind["reranked"] == 0


def test_an_html_description_is_shown_as_text_on_the_page(loaded, index_dir):
    """The MLLM's output is untrusted text: the page sets it with textContent, so a payload shows as
    characters and no element of it exists (a real browser, where Chromium is installed)."""
    pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")
    from demind.search.server import create_app, page_html

    page = page_html()
    assert '$("description").textContent' in page and "description\").innerHTML" not in page
    searcher = searcher_with(loaded, index_dir, setup_with(ScriptedEngine({"make it red": PAYLOAD})))
    data = create_app(searcher).test_client().post(
        "/api/search", data={"gallery_name": "img1.png", "text": "make it red", "method": "osrcir"})
    assert data.status_code == 200 and data.get_json()["description"] == PAYLOAD
    assert data.mimetype == "application/json"


def test_an_html_description_in_a_real_browser(browser, loaded, index_dir):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from demind.search.server import create_app
    from test_search_page import serve

    searcher = searcher_with(loaded, index_dir, setup_with(ScriptedEngine({"make it red": PAYLOAD})))
    server, url = serve(create_app(searcher))
    try:
        wait = WebDriverWait(browser, 60)
        browser.get(url)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#gallery img[data-name='img1.png']"))
        assert "osrcir" in [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "method")).options]
        browser.find_element(By.CSS_SELECTOR, "#gallery img[data-name='img1.png']").click()
        browser.find_element(By.ID, "text").send_keys("make it red")
        Select(browser.find_element(By.ID, "method")).select_by_value("osrcir")
        browser.find_element(By.ID, "search").click()
        wait.until(lambda d: d.find_element(By.ID, "description").is_displayed())
        box = browser.find_element(By.ID, "description")
        assert box.text == f"MLLM description: {PAYLOAD}"
        assert box.find_elements(By.CSS_SELECTOR, "*") == [] and browser.title != "pwned"
        assert len(browser.find_elements(By.CSS_SELECTOR, "#results .hit")) > 0
    finally:
        server.shutdown()


@pytest.fixture()
def browser():
    from test_search_page import CHROMEDRIVER, CHROMIUM

    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (extra 'test')")
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("Chromium not installed: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


# ----------------------------------------------------------------------------- the tiny random LLaVA

@pytest.fixture(autouse=False)
def restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_one_search_with_the_tiny_llava_through_the_transformers_engine(tiny_checkpoint, index_dir, tmp_path,  # noqa: F811
                                                                        restore_torch_threads):
    from demind.engines.tiny_llava import build_tiny_llava_next

    llava = build_tiny_llava_next(tmp_path / "tiny-llava")
    out = tmp_path / "llava.json"
    reference = str(index_dir.parent / "gallery" / "img2.png")
    args = ["--image", reference, "--text", "make it red", "--method", "osrcir", "--out", str(out), "run.device=cpu",
            "engine.name=transformers", f"engine.model={llava}", "engine.dtype=float32", "engine.cpu_threads=1",
            "describe.max_tokens=12", "describe.image_max_side=32"]
    started = time.perf_counter()
    assert search_cli(tiny_checkpoint, index_dir, *args) == 0
    seconds = time.perf_counter() - started
    record = json.loads(out.read_text())["queries"][0]
    assert len(record["results"]) == 9 and "img2.png" not in [r["name"] for r in record["results"]]
    # random weights: the answer has no label, so the counted fallback (the modification text) is searched
    stored = [json.loads(p.read_text()) for p in (index_dir / "descriptions").rglob("part-*.json")]
    (rec,) = [r for part in stored for r in part["records"].values()]
    assert rec["raw"] and rec["description"] in (None, record["description"])
    assert record["description"] == (rec["description"] or "make it red")
    assert seconds < 120


def test_serve_takes_the_engine_sections_of_demind_eval():
    from demind.cli import common, serve
    from demind.cli.model_options import search_mllm_setup

    def config(*extra):
        args = serve.build_parser().parse_intermixed_args(["--index", "i", "--checkpoint", "c", *extra])
        return common.load_command_config(serve.ServeConfig, args)

    assert search_mllm_setup(config()) is None
    setup = search_mllm_setup(config("engine.name=transformers", "engine.model=some/llava", "rerank.k=7",
                                      "describe.hybrid_weight=0.25"))
    assert (setup.model, setup.engine_name, setup.rerank.k, setup.describe.hybrid_weight) == \
        ("some/llava", "transformers", 7, 0.25)
    assert setup.engine.loaded is False  # nothing is loaded before a query needs it
    with pytest.raises(DemindError, match="rerank.k re-ranks with a multimodal LLM"):
        search_mllm_setup(config("rerank.k=7"))


def test_an_mllm_that_cannot_load_is_one_line_on_the_page_and_the_server_keeps_serving(loaded, index_dir):
    pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")
    from demind.errors import MissingInputError
    from demind.search.server import create_app

    def cannot_load():
        raise MissingInputError("engine.model /secret/place/llava is not a folder or hub id; give a llava-hf folder")

    setup = MLLMSetup(cannot_load, model="/secret/place/llava", engine_name="transformers")
    client = create_app(searcher_with(loaded, index_dir, setup)).test_client()
    answer = client.post("/api/search", data={"gallery_name": "img1.png", "text": "make it red", "method": "osrcir"})
    assert answer.status_code == 400 and "not a folder or hub id" in answer.get_json()["error"]
    assert "/secret/place" not in answer.get_json()["error"]
    ok = client.post("/api/search", data={"gallery_name": "img1.png", "text": "make it red", "method": "demind"})
    assert ok.status_code == 200 and len(ok.get_json()["results"]) == 9
