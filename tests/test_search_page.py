"""The search web page: its JSON API (Flask test client) and the page driven in headless
Chromium through Selenium, against a real index and checkpoint served on 127.0.0.1."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")

from demind.search.expectations import expectation_line  # noqa: E402
from demind.search.index import build_index, load_index  # noqa: E402
from demind.search.query import Searcher, SearchQuery  # noqa: E402
from demind.search.server import create_app, start_server  # noqa: E402

from test_search import one_torch_thread, write_image  # noqa: E402,F401  (module fixtures)


@pytest.fixture(scope="module")
def searcher(tmp_path_factory, tiny_checkpoint):  # noqa: F811
    from demind.checkpoint import load_backbone_and_model

    root = tmp_path_factory.mktemp("page")
    for i in range(8):
        write_image(root / "gallery" / f"img{i}.png", i, size=24)
    backbone, model = load_backbone_and_model(tiny_checkpoint)
    build_index(root / "gallery", root / "index", backbone, batch_size=4, progress=False)
    return Searcher(backbone, model, load_index(root / "index"))


@pytest.fixture()
def client(searcher):
    return create_app(searcher).test_client()


def test_api_answers_like_the_searcher(client, searcher):
    info = client.get("/api/info").get_json()
    assert info["gallery_size"] == 8 and info["methods"][0]["name"] == "demind"
    assert client.get("/api/gallery?q=img3").get_json()["names"] == ["img3.png"]
    response = client.post("/api/search", data={"gallery_name": "img3.png", "text": "make it red",
                                                "method": "mapping-only", "k": "4"})
    assert response.status_code == 200
    shown = response.get_json()["results"]
    expected = searcher.search(SearchQuery(image=searcher.index.path_of("img3.png"), text="make it red",
                                           method="mapping-only", k=4, exclude="img3.png"))
    assert [(r["name"], r["score"]) for r in shown] == [(h.name, h.score) for h in expected]
    upload = (searcher.index.path_of("img3.png")).read_bytes()
    uploaded = client.post("/api/search", data={"image": (io.BytesIO(upload), "ref.png"), "text": "",
                                                "method": "image-only", "k": "4"}).get_json()
    # an uploaded copy of a gallery image does not come back as its own first result, and the answer says so
    assert uploaded["duplicates"] == ["img3.png"]
    assert "img3.png" not in [r["name"] for r in uploaded["results"]] and len(uploaded["results"]) == 4
    expected = searcher.search(SearchQuery(image=searcher.index.path_of("img3.png"), text="", method="image-only",
                                           k=4, exclude="img3.png"))
    assert [(r["name"], r["score"]) for r in uploaded["results"]] == [(h.name, h.score) for h in expected]
    thumb = client.get("/thumb?name=img0.png")
    assert thumb.status_code == 200 and thumb.data[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<form" in client.get("/").get_data(as_text=True)


@pytest.mark.parametrize("data, status, message", [
    ({"image": (io.BytesIO(b"not an image"), "x.png"), "text": "red"}, 400, "uploaded reference image cannot be read"),
    ({"gallery_name": "img1.png", "text": "red", "method": "oracle"}, 400, "does not answer a query"),
    ({"gallery_name": "img1.png", "text": "red", "template": "a photo of * , {text:>100000000}"}, 400,
     "has a format spec"),
    ({"gallery_name": "img1.png", "text": "r" * 3000}, 400, "modification text is 3,000 characters"),
    ({"gallery_name": "img1.png", "text": "r" * 600_000}, 413, "a text field is larger than 64 KB"),
    ({"gallery_name": "img1.png", "text": "red", "method": "image-only", "negative": "the dog"}, 400,
     "reads no text, so it cannot exclude"),
    ({"gallery_name": "img1.png", "text": "  "}, 400, "modification text is empty"),
    ({"gallery_name": "../../etc/passwd", "text": "red"}, 400, "not an image of this index"),
    ({"gallery_name": "img1.png", "text": "red", "method": "nope"}, 400, "unknown method"),
    ({"gallery_name": "img1.png", "text": "red", "k": "many"}, 400, "k must be a whole number"),
])
def test_bad_requests_get_a_message_and_the_server_keeps_serving(client, data, status, message):
    response = client.post("/api/search", data=data, content_type="multipart/form-data")
    assert response.status_code == status
    error = response.get_json()["error"]
    assert message in error and "larger than 20 MB" not in error and "Error" not in error
    assert client.post("/api/search", data={"gallery_name": "img1.png", "text": "red"}).status_code == 200


def test_an_upload_over_the_body_limit_is_a_413_naming_the_limit(searcher):
    from demind.search.server import ServerSettings

    client = create_app(searcher, settings=ServerSettings(max_upload_mb=1)).test_client()
    big = io.BytesIO(b"\x89PNG\r\n\x1a\n" + bytes(2 * 1024 * 1024))  # 2 MB, never decoded
    response = client.post("/api/search", data={"image": (big, "big.png"), "text": "red"},
                           content_type="multipart/form-data")
    assert response.status_code == 413
    assert response.get_json()["error"] == "the upload is larger than 1 MB; choose a smaller image"
    assert client.post("/api/search", data={"gallery_name": "img1.png", "text": "red"}).status_code == 200


def test_unexpected_failure_is_one_line_and_the_next_query_works(searcher, monkeypatch):
    client = create_app(searcher).test_client()
    real = searcher.search_with_details
    monkeypatch.setattr(searcher, "search_with_details", lambda q: (_ for _ in ()).throw(RuntimeError("boom")))
    response = client.post("/api/search", data={"gallery_name": "img1.png", "text": "red"})
    assert response.status_code == 500
    assert response.get_json()["error"] == "internal error; the server log has the details"  # no exception name
    monkeypatch.setattr(searcher, "search_with_details", real)
    assert client.post("/api/search", data={"gallery_name": "img1.png", "text": "red"}).status_code == 200
    assert client.get("/thumb?name=../secret").status_code == 404


def test_an_index_of_another_backbone_is_shown_on_the_page(searcher):
    client = create_app(None, problem="index X was built with backbone A, but the checkpoint's backbone is B").test_client()
    assert "checkpoint's backbone is B" in client.get("/api/info").get_json()["problem"]
    response = client.post("/api/search", data={"text": "red"})
    assert response.status_code == 400 and "backbone is B" in response.get_json()["error"]


# ---------------------------------------------------------------------------------- browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture()
def browser():
    """Headless system Chromium through Selenium (its own chromedriver, so Selenium Manager
    never downloads anything). Skips when Chromium is not installed."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (extra 'test')")
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("Chromium not installed: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def serve(app):
    server, thread = start_server(app, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.port}/"


def test_page_in_a_real_browser(browser, searcher, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait

    server, url = serve(create_app(searcher))
    try:
        wait = WebDriverWait(browser, 60)
        browser.get(url)
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#gallery img.pick[data-name='img5.png']")))
        assert [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "method")).options] == \
            searcher.available_methods()
        # which ranker and what recall to expect: demind-serve's start-up line, shown as text
        assert browser.find_element(By.ID, "ranker").text == expectation_line(searcher.expectation)

        # pick a reference from the gallery, type a text, choose a method, search
        browser.find_element(By.CSS_SELECTOR, "#gallery img[data-name='img5.png']").click()
        browser.find_element(By.ID, "text").send_keys("make it red")
        Select(browser.find_element(By.ID, "method")).select_by_value("demind")
        Select(browser.find_element(By.ID, "k")).select_by_value("10")
        browser.find_element(By.ID, "search").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .hit")) > 0)
        cards = browser.find_elements(By.CSS_SELECTOR, "#results .hit")
        expected = searcher.search(SearchQuery(image=searcher.index.path_of("img5.png"), text="make it red",
                                               method="demind", k=10, exclude="img5.png"))
        assert [c.get_attribute("data-name") for c in cards] == [h.name for h in expected]  # 7: all but the reference
        assert cards[0].find_element(By.CLASS_NAME, "score").text == f"score {expected[0].score:.4f}"
        wait.until(lambda d: d.execute_script(  # the thumbnails really loaded
            "return [...document.querySelectorAll('#results img')].every(i => i.complete && i.naturalWidth > 0)"))

        # an unreadable upload: a message on the page, not a traceback; then the server still answers
        broken = tmp_path / "broken.png"
        broken.write_bytes(b"this is not a png")
        browser.find_element(By.ID, "file").send_keys(str(broken))
        browser.find_element(By.ID, "search").click()
        error = wait.until(EC.visibility_of_element_located((By.ID, "error")))
        assert "uploaded reference image cannot be read" in error.text and "Traceback" not in error.text
        # where the results were: the old results are gone, the status says so, the error is in view
        assert browser.find_elements(By.CSS_SELECTOR, "#results .hit") == []
        assert "search failed" in browser.find_element(By.ID, "status").text
        assert browser.execute_script("return document.getElementById('error').getBoundingClientRect().bottom") \
            <= browser.execute_script("return window.innerHeight")

        # an empty text
        browser.find_element(By.CSS_SELECTOR, "#gallery img[data-name='img2.png']").click()
        browser.find_element(By.ID, "text").clear()
        browser.find_element(By.ID, "search").click()
        wait.until(lambda d: "modification text is empty" in d.find_element(By.ID, "error").text)

        # and a good query again, with something to leave out: searched as DEO, and the status says so
        browser.find_element(By.ID, "text").send_keys("make it blue")
        browser.find_element(By.ID, "negative").send_keys("the circle")
        assert "DEO" in browser.find_element(By.ID, "negative-hint").text
        Select(browser.find_element(By.ID, "method")).select_by_value("text-only")
        browser.find_element(By.ID, "search").click()
        wait.until(lambda d: "make it blue" in d.find_element(By.ID, "status").text)
        status = browser.find_element(By.ID, "status").text
        assert "make it blue, without the circle" in status and "+ DEO" in status
        assert "leaving out “the circle”" in status
        assert not browser.find_element(By.ID, "error").is_displayed()
        cards = browser.find_elements(By.CSS_SELECTOR, "#results .hit")
        expected = searcher.search(SearchQuery(image=searcher.index.path_of("img2.png"), text="make it blue",
                                               negative="the circle", method="text-only", k=20, exclude="img2.png"))
        assert [c.get_attribute("data-name") for c in cards] == [h.name for h in expected]
    finally:
        server.shutdown()


def test_page_with_a_token_opens_from_the_printed_address(browser, searcher):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    from demind.search.server import ServerSettings

    server, url = serve(create_app(searcher, settings=ServerSettings(token="page-token")))
    try:
        browser.get(url)  # without the token: one line saying what to open
        assert "access token" in browser.find_element(By.TAG_NAME, "body").text
        browser.get(url + "?token=page-token")
        wait = WebDriverWait(browser, 60)
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#gallery img.pick[data-name='img5.png']")))
        assert "token" not in browser.current_url  # moved into the cookie
        wait.until(lambda d: d.execute_script(  # thumbnails (plain <img> requests) carry the cookie too
            "return [...document.querySelectorAll('#gallery img')].every(i => i.complete && i.naturalWidth > 0)"))
    finally:
        server.shutdown()


def test_page_shows_an_index_of_another_backbone(browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    server, url = serve(create_app(None, problem="index X was built with backbone A, but the checkpoint's "
                                                 "backbone is B; rebuild the index"))
    try:
        browser.get(url)
        banner = WebDriverWait(browser, 60).until(EC.visibility_of_element_located((By.ID, "problem")))
        assert "checkpoint's backbone is B" in banner.text
        assert not browser.find_element(By.ID, "search").is_enabled()
        assert not browser.find_element(By.ID, "ranker").is_displayed()  # no index: no ranker to speak of
    finally:
        server.shutdown()


def test_shard_members_are_shown_and_can_be_the_reference(tmp_path, searcher):
    from test_search import write_shard

    backbone, model = searcher.backbone, searcher.model
    pngs = {f"m{i}.png": write_image(tmp_path / "src" / f"m{i}.png", 40 + i).read_bytes() for i in range(3)}
    write_shard(tmp_path / "gallery" / "00000.tar", pngs)
    build_index(tmp_path / "gallery", tmp_path / "index", backbone, progress=False)
    client = create_app(Searcher(backbone, model, load_index(tmp_path / "index"))).test_client()
    thumb = client.get("/thumb?name=00000.tar/m1.png")
    assert thumb.status_code == 200 and thumb.data[:4] == b"\x89PNG"
    response = client.post("/api/search", data={"gallery_name": "00000.tar/m1.png", "text": "red", "k": "5"})
    assert response.status_code == 200
    assert sorted(r["name"] for r in response.get_json()["results"]) == ["00000.tar/m0.png", "00000.tar/m2.png"]


def test_serve_command_builds_the_index_and_serves_a_mismatch_as_a_page_message(tmp_path, tiny_checkpoint,  # noqa: F811
                                                                                  tiny_backbone, monkeypatch, capsys):
    import threading

    import demind.search.server as server_module
    from demind.cli.serve import main as serve_main

    apps = []

    class Stopped:
        port = 1234

    def fake_start_server(app, host, port):  # record the app instead of blocking on a real server
        apps.append(app)
        done = threading.Thread(target=lambda: None)
        done.start()
        return Stopped(), done

    monkeypatch.setattr(server_module, "start_server", fake_start_server)
    monkeypatch.setattr(server_module.guard, "bind_problem", lambda host, port: None)  # no real socket
    for i in range(3):
        write_image(tmp_path / "gallery" / f"g{i}.png", i)
    common = ["--checkpoint", str(tiny_checkpoint), "run.progress=false"]
    assert serve_main(["--index", str(tmp_path / "idx"), "--images", str(tmp_path / "gallery"), *common]) == 0
    assert "3 images (3 encoded" in capsys.readouterr().out
    info = apps[-1].test_client().get("/api/info").get_json()
    assert info["problem"] is None and info["gallery_size"] == 3

    build_index(tmp_path / "gallery", tmp_path / "other", tiny_backbone, progress=False)  # another backbone
    assert serve_main(["--index", str(tmp_path / "other"), *common]) == 0  # still serves ...
    info = apps[-1].test_client().get("/api/info").get_json()
    assert "checkpoint's backbone" in info["problem"]  # ... the page says what is wrong
    assert serve_main(["--quickstart", str(tmp_path / "no-quickstart")]) == 2
    assert "run the quickstart first" in capsys.readouterr().err
