"""The search server is safe by default and safe to expose: plain-name templates, host and
origin checks, the access token, upload limits in bytes and pixels, error text and logs that
leak nothing, and waitress's bounded worker pool against stalled clients on a real socket."""

from __future__ import annotations

import io
import json
import logging
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import zlib

import pytest

pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")
pytest.importorskip("waitress", reason="waitress not installed (optional extra 'search')")

from demind.templates import TemplateError, fill_template, template_field  # noqa: E402
from demind.search.guard import host_name, redact_paths, shorten  # noqa: E402
from demind.search.query import SearchQuery  # noqa: E402
from demind.search.server import ServerSettings, ServerSetupError, create_app, start_server  # noqa: E402

from test_search import one_torch_thread, write_image  # noqa: E402,F401  (module fixtures)
from test_search_page import searcher  # noqa: E402,F401  (module fixture: 8 images, tiny checkpoint)

GOOD = {"gallery_name": "img1.png", "text": "make it red", "method": "mapping-only", "k": "3"}


def post(client, data=None, **kw):
    return client.post("/api/search", data=data or GOOD, content_type="multipart/form-data", **kw)


# ---------------------------------------------------------------------------------- templates

@pytest.mark.parametrize("template, problem", [
    ("a photo of * , {text:>100000000}", "has a format spec"),
    ("a photo of * , {text!r}", "has a conversion"),
    ("a photo of * , {text.__class__}", "is not one of {text}"),
    ("a photo of * , {text[0]}", "is not one of {text}"),
    ("a photo of * , {0}", "is not one of {text}"),
    ("a photo of * , {}", "is not one of {text}"),
    ("a photo of * , {text", "unmatched"),
    ("a photo of * , {text} {domain}", "needs one '*'"),
    ("a photo of {text}", "needs one '*'"),
    ("x" * 2000 + " * {text}", "at most 1,000"),
])
def test_a_template_is_plain_text_with_one_plain_field(searcher, template, problem):  # noqa: F811
    with pytest.raises(TemplateError, match=problem.replace("*", r"\*").replace("{", r"\{")):
        template_field(template)
    start = time.perf_counter()
    response = post(create_app(searcher).test_client(), {**GOOD, "template": template})
    assert time.perf_counter() - start < 2.0  # refused from parsing, before any padding or model work
    assert response.status_code == 400 and problem in response.get_json()["error"]


def test_filling_a_template_joins_its_parts_like_format_did():
    assert fill_template("a photo of * , {text}", text="make it red") == "a photo of * , make it red"
    assert fill_template("a {domain} of * {{braces}}", domain="sketch") == "a sketch of * {braces}"
    assert fill_template("* , {text}", text="{0} {text.__class__}") == "* , {0} {text.__class__}"  # values stay text


# ---------------------------------------------------------------------------------- host, origin, token

def test_only_allowed_host_names_are_answered(searcher):  # noqa: F811
    client = create_app(searcher).test_client()
    assert client.get("/api/info", headers={"Host": "localhost:8000"}).status_code == 200
    assert client.get("/api/info", headers={"Host": "[::1]:8000"}).status_code == 200
    rebound = client.get("/api/gallery", headers={"Host": "evil.example:8000"})  # DNS rebinding
    assert rebound.status_code == 403 and "--allowed-host evil.example" in rebound.get_json()["error"]
    assert client.get("/thumb?name=img0.png", headers={"Host": "evil.example"}).status_code == 403
    allowed = create_app(searcher, settings=ServerSettings(allowed_hosts=("photos.lan",))).test_client()
    assert allowed.get("/api/info", headers={"Host": "photos.lan:8000"}).status_code == 200
    assert host_name("Photos.LAN.:80") == "photos.lan"


def test_a_post_from_another_site_is_refused(searcher):  # noqa: F811
    client = create_app(searcher).test_client()
    cross = post(client, headers={"Origin": "http://evil.example"})
    assert cross.status_code == 403 and "another site" in cross.get_json()["error"]
    assert post(client, headers={"Origin": "null"}).status_code == 403
    assert post(client, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert post(client, headers={"Origin": "http://localhost"}).status_code == 200  # the page itself
    assert post(client).status_code == 200  # curl and scripts send no Origin


def test_the_token_is_needed_by_the_api_and_carried_to_the_page_by_a_cookie(searcher):  # noqa: F811
    app = create_app(searcher, settings=ServerSettings(token="s3cret-token"))
    client = app.test_client()
    for path in ("/", "/api/info", "/api/gallery", "/thumb?name=img0.png"):
        refused = client.get(path)
        assert refused.status_code == 401 and "access token" in refused.get_json()["error"]
    assert post(client).status_code == 401
    assert client.get("/api/info", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/?token=wrong").status_code == 401
    assert client.get("/api/info", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    assert post(client, headers={"Authorization": "Bearer s3cret-token"}).status_code == 200

    landing = client.get("/?token=s3cret-token")  # the printed address
    assert landing.status_code == 303 and landing.headers["Location"].endswith("/")  # the token leaves the URL
    cookie = landing.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert "<form" in client.get("/").get_data(as_text=True)  # the test client keeps the cookie
    assert client.get("/thumb?name=img0.png").status_code == 200
    assert post(client).status_code == 200


def test_off_loopback_a_server_without_a_token_does_not_start(searcher):  # noqa: F811
    with pytest.raises(ServerSetupError, match="needs an access token"):
        start_server(create_app(searcher), "0.0.0.0", 0)


def test_serve_warns_off_loopback_and_prints_a_generated_token(tmp_path, tiny_checkpoint, monkeypatch,  # noqa: F811
                                                               capsys):
    import demind.search.guard as guard
    import demind.search.server as server_module
    from demind.cli.serve import main as serve_main

    apps = []

    class Stopped:
        port = 8123

    def fake_start_server(app, host, port):  # record the app instead of blocking on a real server
        apps.append((app, host))
        done = threading.Thread(target=lambda: None)
        done.start()
        return Stopped(), done

    monkeypatch.setattr(server_module, "start_server", fake_start_server)
    monkeypatch.setattr(guard, "bind_problem", lambda host, port: None)  # no real socket: 192.168.1.5 is an example
    monkeypatch.delenv("DEMIND_SERVE_TOKEN", raising=False)
    for i in range(3):
        write_image(tmp_path / "gallery" / f"g{i}.png", i)
    common = ["--index", str(tmp_path / "idx"), "--images", str(tmp_path / "gallery"), "--checkpoint",
              str(tiny_checkpoint), "run.progress=false"]
    assert serve_main([*common, "--host", "0.0.0.0", "--allowed-host", "photos.lan"]) == 0
    captured = capsys.readouterr()
    assert "warning: --host 0.0.0.0 lets other machines connect" in captured.err
    token = captured.out.split("generated access token")[1].split(": ", 1)[1].split()[0]
    assert len(token) >= 30 and f"http://127.0.0.1:8123/?token={token}" in captured.out
    client = apps[-1][0].test_client()
    assert client.get("/api/info", headers={"Host": "photos.lan"}).status_code == 401
    authorised = {"Host": "photos.lan", "Authorization": f"Bearer {token}"}
    assert client.get("/api/info", headers=authorised).status_code == 200

    monkeypatch.setenv("DEMIND_SERVE_TOKEN", "from-the-environment")
    assert serve_main([*common, "--host", "192.168.1.5"]) == 0
    assert "generated" not in capsys.readouterr().out
    assert apps[-1][0].test_client().get("/api/info", headers={
        "Host": "localhost", "Authorization": "Bearer from-the-environment"}).status_code == 200


# ---------------------------------------------------------------------------------- limits and API defects

def bomb_png(side: int = 12000) -> bytes:
    """A real 1-bit PNG of side x side white pixels: ~20 KB that decode to side**2 * 3 bytes of RGB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    row = b"\x00" + b"\xff" * (side // 8)
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow warns from the header too
def test_a_decompression_bomb_is_refused_from_its_header(searcher):  # noqa: F811
    data = bomb_png()
    assert len(data) < 200_000
    start = time.perf_counter()
    response = post(create_app(searcher).test_client(),
                    {"image": (io.BytesIO(data), "bomb.png"), "text": "red", "method": "image-only"})
    assert time.perf_counter() - start < 1.0  # decoding 144 megapixels takes seconds and ~430 MB
    assert response.status_code == 400
    assert "12000 x 12000 pixels (144 megapixels); the limit is 40 megapixels" in response.get_json()["error"]


def test_gallery_limit_is_capped_and_a_bad_one_is_a_400(searcher):  # noqa: F811
    client = create_app(searcher).test_client()
    assert client.get("/api/gallery?limit=-1").get_json()["names"] == []  # not names[:-1]: the cap holds
    assert len(client.get("/api/gallery?limit=100000").get_json()["names"]) == 8
    bad = client.get("/api/gallery?limit=abc")
    assert bad.status_code == 400 and "limit must be a whole number" in bad.get_json()["error"]


def test_errors_name_no_server_path_or_exception_and_logs_shorten_texts(searcher, caplog):  # noqa: F811
    client = create_app(searcher).test_client()
    assert "/" not in client.get("/api/info").get_json()["index"]
    junk = post(client, {"image": (io.BytesIO(b"\x89PNG\r\n\x1a\nbroken"), "x.png"), "text": "red"}).get_json()
    assert "BytesIO" not in junk["error"] and "Error" not in junk["error"]
    problem = create_app(None, problem="index /srv/data/photos/idx was built with A; rebuild it").test_client()
    shown = problem.get("/api/info").get_json()["problem"]
    assert shown == "index idx was built with A; rebuild it"
    assert "/srv/" not in post(problem).get_json()["error"]
    assert redact_paths(r"cannot read C:\Users\me\photos\a.png") == "cannot read a.png"

    caplog.set_level(logging.INFO, logger="demind.search.server")
    long_text = "make it red " * 160  # 1,920 characters, under the text limit
    assert post(client, {**GOOD, "text": long_text}).status_code == 200
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("query ")][-1]
    assert len(line) < 300 and "(1,920 characters)" in line
    assert shorten("abc") == "'abc'"


def test_the_negative_is_searched_as_deo_and_recorded(searcher):  # noqa: F811
    client = create_app(searcher).test_client()
    data = post(client, {**GOOD, "method": "demind", "negative": " the dog "}).get_json()
    assert (data["method"], data["text"], data["negative"]) == ("demind+deo", "make it red, without the dog", "the dog")
    expected = searcher.search(SearchQuery(image=searcher.index.path_of("img1.png"), text="make it red, without "
                                           "the dog", method="demind+deo", k=3, exclude="img1.png"))
    assert [(r["name"], r["score"]) for r in data["results"]] == [(h.name, h.score) for h in expected]
    plain = post(client, {**GOOD, "method": "demind"}).get_json()
    assert (plain["method"], plain["negative"]) == ("demind", None)
    assert [r["score"] for r in plain["results"]] != [r["score"] for r in data["results"]]


def test_a_busy_model_answers_503_after_the_query_timeout(searcher, monkeypatch):  # noqa: F811
    client = create_app(searcher, settings=ServerSettings(query_timeout_s=0.5)).test_client()
    entered, release = threading.Event(), threading.Event()
    real = searcher.search_with_details

    def slow(query):
        entered.set()
        release.wait(10)
        return real(query)

    monkeypatch.setattr(searcher, "search_with_details", slow)
    first = threading.Thread(target=lambda: post(client))
    first.start()
    assert entered.wait(10)
    busy = post(client)
    release.set()
    first.join(10)
    assert busy.status_code == 503 and "busy" in busy.get_json()["error"]


# ---------------------------------------------------------------------------------- waitress, real socket

def test_stalled_clients_hold_no_threads_and_are_timed_out(searcher):  # noqa: F811
    settings = ServerSettings(channel_timeout_s=1.0, threads=2, connection_limit=100)
    server, _ = start_server(create_app(searcher, settings=settings), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}"
    stalled: list[socket.socket] = []
    try:
        with urllib.request.urlopen(f"{url}/api/info", timeout=10) as answer:
            assert json.load(answer)["gallery_size"] == 8
        threads_before = threading.active_count()
        halves = (b"POST /api/search HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # headers never end
                  b"POST /api/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                  b"boundary=b\r\nContent-Length: 1000\r\n\r\n--b\r\n")  # the body never comes
        for i in range(300):  # each sends half a request, then nothing
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(halves[i % 2])
            stalled.append(s)
        time.sleep(0.5)
        assert threading.active_count() <= threads_before  # werkzeug made one thread per client (304)
        start = time.monotonic()
        assert stalled[0].recv(1024) == b""  # closed by the server after the channel timeout, no answer
        assert time.monotonic() - start < 5
        with urllib.request.urlopen(f"{url}/api/gallery?q=img2", timeout=20) as answer:  # served once slots free up
            assert json.load(answer)["names"] == ["img2.png"]
        assert threading.active_count() <= threads_before
        request = urllib.request.Request(f"{url}/api/search", data=b"text=red&gallery_name=img1.png&k=2",
                                         headers={"Origin": "http://evil.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 403
    finally:
        for s in stalled:
            s.close()
        server.shutdown()


def test_shutdown_returns_after_the_servers_threads_have_ended(searcher):  # noqa: F811
    """The model must be freed by the thread that stops the server, never by a server thread
    ending during interpreter exit: Python ends that thread inside torch's tensor deallocation
    and the process aborts (status -6) instead of exiting 0. Stopped as demind-serve is: Ctrl-C
    interrupts its join() of the loop thread (which, before Python 3.13, marks that thread as
    ended while it still runs)."""
    import gc
    import os
    import signal
    import weakref

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    app = create_app(searcher, settings=ServerSettings(threads=3))
    before = set(threading.enumerate())
    server, loop = start_server(app, "127.0.0.1", 0)
    port = server.port
    workers = [t for t in threading.enumerate() if t not in before and t is not loop]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/search",
                                     data=b"text=make+it+red&gallery_name=img1.png&k=2&method=mapping-only")
    with urllib.request.urlopen(request, timeout=30) as answer:  # a worker thread runs the model
        assert [r["name"] for r in json.load(answer)["results"]] != []
    held = socket.create_connection(("127.0.0.1", port), timeout=10)  # an open, idle connection
    assert loop.is_alive() and len(workers) == 3 and all(t.is_alive() for t in workers)
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(KeyboardInterrupt):
            loop.join(30)  # demind-serve's wait, stopped by a signal
    finally:
        signal.signal(signal.SIGUSR1, previous)
    server.shutdown()
    app_ref = weakref.ref(app)
    del app, server, loop, workers
    gc.collect()
    assert app_ref() is None  # no thread of the server holds the app (and the model) any more
    assert held.recv(1024) == b""  # the idle connection was closed
    held.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_printed_address_opens_with_a_base64_token(tmp_path, tiny_checkpoint, monkeypatch, capsys):  # noqa: F811
    """``openssl rand -base64`` gives tokens with '+', '/' and '=': the address demind-serve prints
    carries it URL-encoded, so opening that address is let in (not a 401 naming that address)."""
    import urllib.parse

    import demind.search.server as server_module
    from demind.cli.serve import main as serve_main

    apps = []

    class Stopped:
        port = 8124

    def fake_start_server(app, host, port):
        apps.append(app)
        done = threading.Thread(target=lambda: None)
        done.start()
        return Stopped(), done

    monkeypatch.setattr(server_module, "start_server", fake_start_server)
    token = "a+b/c=d+/x9Q=="
    for i in range(2):
        write_image(tmp_path / "gallery" / f"g{i}.png", i)
    assert serve_main(["--index", str(tmp_path / "idx"), "--images", str(tmp_path / "gallery"), "--checkpoint",
                       str(tiny_checkpoint), "run.progress=false", "--host", "0.0.0.0", "--token", token]) == 0
    address = capsys.readouterr().out.split("demind search: ")[1].split()[0]
    url = urllib.parse.urlsplit(address)
    assert urllib.parse.parse_qs(url.query)["token"] == [token]  # what a browser sends back
    client = apps[-1].test_client()
    landing = client.get(f"/?{url.query}", headers={"Host": "localhost"})
    assert landing.status_code == 303
    assert client.get("/api/info", headers={"Host": "localhost"}).status_code == 200  # the cookie carries it
