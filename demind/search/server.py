"""The search web page: a small Flask app over one loaded :class:`~demind.search.query.Searcher`,
served by waitress.

Flask is chosen because the page needs four routes, one upload and JSON: Flask does that with
no async runtime, no build step and no assets from a CDN. (gradio would bring a large front-end
bundle and fonts fetched online; FastAPI needs uvicorn and python-multipart for the same four
routes.) The page itself is one offline HTML file, ``static/search.html``.

It is served by waitress, a production WSGI server in pure Python (Linux, macOS, Windows; no
compiler): requests are read by one asynchronous loop and handed complete to a fixed pool of
worker threads, so a client that stalls holds a connection slot (closed after
``channel_timeout``) and never a thread; ``connection_limit`` and ``max_request_body_size``
bound the rest. werkzeug's development server starts one thread per connection and never
times one out (300 stalled clients made 304 threads).

Safe by default (see :mod:`demind.search.guard`): only the allowed host names are answered
(DNS rebinding), a browser POST from another site is refused, off loopback every request needs
the token, an upload is limited in bytes and pixels, a query waits at most
``query_timeout_s`` for the model, and a template is plain text with one field.

The index and the model are loaded once, before the app is built; an MLLM (the searcher's
``engine`` section) once, on the first query that needs it, under the same one-query lock.
Its description of a query comes back as JSON text, which the page shows as text, never as HTML. Every bad request is
answered with a JSON ``{"error": message}`` that the page shows, without server paths or
Python exception names; an unexpected failure is logged with its traceback on the server and
the page gets one line; the server keeps serving.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache, partial
from importlib import resources

from demind.errors import DemindError, MissingDependencyError
from demind.retrieval import ImageRef, load_image

try:
    import waitress.server
    import waitress.task
    from flask import Flask, Response, jsonify, redirect, request
    from werkzeug.exceptions import HTTPException, RequestEntityTooLarge
except ImportError as e:  # an optional extra: say how to get it instead of a traceback
    raise MissingDependencyError(f"the search page needs Flask and waitress: pip install -e '.[search]' ({e})") from e
from demind.search import guard
from demind.search.expectations import expectation_line
from demind.search.index_manifest import GalleryIndexError
from demind.search.query import SearchError, Searcher, SearchQuery, method_label
from demind.search.names import DEFAULT_TEMPLATE

log = logging.getLogger(__name__)

THUMB_SIDE = 192
MAX_K = 200
MAX_GALLERY_NAMES = 500
TOKEN_COOKIE = "demind_token"
SETTINGS_KEY = "DEMIND_SERVER"


class ServerSetupError(DemindError):
    """A server that would be unsafe to start as asked (e.g. off loopback without a token)."""


@dataclass
class ServerSettings:
    """Limits and access rules of one server.

    token: required from every request when set (``Authorization: Bearer TOKEN``, or the cookie
        the page sets after ``/?token=TOKEN``); required to serve off loopback.
    allowed_hosts: extra ``Host`` names answered besides loopback and the bound host ("*": any).
    max_upload_mb: request body limit (the reference image upload).
    max_form_kb: limit of one text field of a request (the modification text, the template).
    threads: waitress worker threads; connection_limit: open connections at most;
    channel_timeout_s: an idle or stalled connection is closed after this;
    query_timeout_s: a query that cannot get the model within this is answered 503.
    """

    token: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    max_upload_mb: int = 20
    max_form_kb: int = 64
    threads: int = 4
    connection_limit: int = 100
    channel_timeout_s: float = 30.0
    query_timeout_s: float = 30.0
    hosts: set[str] = field(default_factory=lambda: set(guard.LOOPBACK_NAMES), repr=False)  # filled by start_server

    def __post_init__(self) -> None:
        self.hosts |= {guard.host_name(h) if h != guard.ANY_HOST else h for h in self.allowed_hosts}


def page_html() -> str:
    """The page (HTML, CSS and JS in one package-data file; nothing is fetched online)."""
    return resources.files("demind.search").joinpath("static/search.html").read_text(encoding="utf-8")


def thumbnail_png(ref: ImageRef, side: int = THUMB_SIDE) -> bytes:
    """A PNG no larger than ``side`` pixels (small images are sent as they are; the page scales them)."""
    img = load_image(ref)
    img.thumbnail((side, side))
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def failure(message: str, status: int = 400):
    """The JSON error every route answers with; server paths cut to their last part."""
    return jsonify({"error": guard.redact_paths(message)}), status


def whole_number(name: str, raw: str | None, default: int, low: int, high: int) -> int:
    """A query argument clamped to [low, high]; SearchError naming it when it is not a number."""
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SearchError(f"{name} must be a whole number, got {raw[:40]!r}") from None
    return max(low, min(value, high))


def install_guards(app: Flask, settings: ServerSettings) -> None:
    """Host, origin and token checks before every route (see :mod:`demind.search.guard`)."""

    @app.before_request
    def check_request():
        host = request.headers.get("Host", "")
        if not guard.host_allowed(host, settings.hosts):
            name = guard.host_name(host)[:100]
            return failure(f"host {name!r} is not served here; if this server should answer to it, start "
                           f"demind-serve with --allowed-host {name or 'NAME'}", 403)
        if request.method not in ("GET", "HEAD", "OPTIONS") and (
                not guard.origin_allowed(request.headers.get("Origin"), host)
                or request.headers.get("Sec-Fetch-Site") == "cross-site"):
            return failure("a request from another site was refused; open the search page itself", 403)
        if settings.token is None:
            return None
        if request.path == "/" and guard.token_matches(request.args.get("token"), settings.token):
            # the printed address carries the token once; the cookie carries it on (thumbnails too)
            response = redirect("/", code=303)
            response.set_cookie(TOKEN_COOKIE, settings.token, httponly=True, samesite="Strict")
            return response
        given = guard.bearer_token(request.headers.get("Authorization")) or request.cookies.get(TOKEN_COOKIE)
        if not guard.token_matches(given, settings.token):
            return failure("this server needs its access token: open the address demind-serve printed "
                           "(it ends in ?token=...), or send 'Authorization: Bearer TOKEN'", 401)
        return None


def create_app(searcher: Searcher | None, problem: str | None = None,
               settings: ServerSettings | None = None) -> Flask:
    """The Flask app. ``searcher`` None with a ``problem`` (e.g. an index of another backbone)
    serves the page with that message instead of results, so the user sees what to fix."""
    if searcher is None and not problem:
        raise ValueError("create_app needs a searcher or a problem to show")  # a caller's bug, not input
    settings = settings or ServerSettings()
    app = Flask(__name__)
    app.config[SETTINGS_KEY] = settings
    app.config["MAX_CONTENT_LENGTH"] = settings.max_upload_mb * 1024 * 1024
    app.config["MAX_FORM_MEMORY_SIZE"] = settings.max_form_kb * 1024
    install_guards(app, settings)
    register_routes(app, SearchRoutes(searcher, problem, settings))
    register_error_handlers(app, settings)
    return app


def indexed_thumbnail(searcher: Searcher, name: str) -> bytes:
    """The PNG thumbnail of the indexed image ``name`` (see :func:`thumbnail_png`)."""
    return thumbnail_png(searcher.index.image_ref(name))


class SearchRoutes:
    """The page's routes over one searcher, or over the ``problem`` shown instead of results.

    Holds no reference back to itself (the thumbnail cache wraps a module function, not a
    method), so the model is freed as soon as the app is let go (see :class:`RunningServer`).
    """

    def __init__(self, searcher: Searcher | None, problem: str | None, settings: ServerSettings) -> None:
        self.searcher = searcher
        self.problem = problem
        self.settings = settings
        self.lock = threading.Lock()  # one query at a time through the model (torch modules are not re-entrant-safe)
        self.rows = {name: i for i, name in enumerate(searcher.index.names)} if searcher else {}
        self.shown_problem = guard.redact_paths(problem) if problem else None
        self.thumbnail = lru_cache(maxsize=4096)(partial(indexed_thumbnail, searcher))

    def index_page(self) -> Response:
        """GET /: the page."""
        return Response(page_html(), mimetype="text/html")

    def info(self) -> Response:
        """GET /api/info: the methods, the gallery's size, the ranker, the index and the MLLM (or the problem)."""
        searcher = self.searcher
        if searcher is None:
            return jsonify({"problem": self.shown_problem, "methods": [], "gallery_size": 0})
        return jsonify({
            "problem": None,
            "methods": [{"name": m, "label": method_label(m)} for m in searcher.available_methods()],
            "template": DEFAULT_TEMPLATE,
            "gallery_size": len(searcher.index),
            "ranker": searcher.expectation,  # which ranker, and its recall@10 ("exact" or measured)
            "ranker_line": expectation_line(searcher.expectation),  # the line demind-serve printed; the page shows it
            "index": searcher.index.directory.name,  # the folder's name: where it lies is the server's business
            "backbone": searcher.index.backbone,
            "mllm": searcher.mllm.summary() if searcher.mllm is not None else None,
        })

    def gallery(self) -> Response:
        """Gallery names containing ``q`` (to pick a reference), ``limit`` at most (and at most 500)."""
        searcher = self.searcher
        limit = whole_number("limit", request.args.get("limit"), 48, 0, MAX_GALLERY_NAMES)
        if searcher is None:
            return jsonify({"names": [], "total": 0})
        needle = request.args.get("q", "").strip().lower()
        names = [n for n in searcher.index.names if needle in n.lower()] if needle else searcher.index.names
        return jsonify({"names": names[:limit], "total": len(names)})

    def thumb(self) -> Response | tuple[Response, int]:
        """GET /thumb?name=NAME: the PNG thumbnail of an indexed image (404 for any other name)."""
        name = request.args.get("name", "")
        if self.searcher is None or name not in self.rows:  # only indexed files are served
            return failure(f"{name[:200]!r} is not in the index", 404)
        try:
            return Response(self.thumbnail(name), mimetype="image/png")
        except OSError:
            log.warning("thumbnail of %s failed", name, exc_info=True)
            return failure(f"cannot read {name}", 404)

    def search(self) -> Response | tuple[Response, int]:
        """POST /api/search: one query through the model, one at a time (503 after ``query_timeout_s``)."""
        searcher, settings = self.searcher, self.settings
        if searcher is None:
            raise SearchError(self.problem)
        query = read_search_form(searcher, self.rows)
        start = time.perf_counter()
        if not self.lock.acquire(timeout=settings.query_timeout_s):
            return failure(f"the server is busy (no query finished within {settings.query_timeout_s:g} s); "
                           f"try again shortly", 503)
        try:
            outcome = searcher.search_with_details(query)
        finally:
            self.lock.release()
        elapsed = time.perf_counter() - start
        log.info("query %s (%s): %d results in %.1f ms", guard.shorten(outcome.text), outcome.method,
                 len(outcome.hits), elapsed * 1000)
        return jsonify({
            "results": [{"rank": h.rank, "name": h.name, "score": h.score} for h in outcome.hits],
            "method": outcome.method, "text": outcome.text, "negative": outcome.negative,
            "excluded": query.exclude, "duplicates": outcome.duplicates,
            "description": outcome.description, "reranked": outcome.reranked,
            "elapsed_ms": round(elapsed * 1000, 1),
        })


def register_routes(app: Flask, routes: SearchRoutes) -> None:
    """The page and its four API routes; endpoint names are the route methods' names."""
    for rule, view, method in (("/", routes.index_page, "GET"), ("/api/info", routes.info, "GET"),
                               ("/api/gallery", routes.gallery, "GET"), ("/thumb", routes.thumb, "GET"),
                               ("/api/search", routes.search, "POST")):
        app.add_url_rule(rule, endpoint=view.__name__, view_func=view, methods=[method])


def register_error_handlers(app: Flask, settings: ServerSettings) -> None:
    """Every failure answered as one JSON line (see :func:`failure`); the server keeps serving."""

    def bad_query(error):
        return failure(str(error), 400)

    def setup_problem(error):
        # e.g. the MLLM of engine.model cannot be loaded, or re-ranking on an engine without logits:
        # the server's configuration, told in its one line (paths cut) and logged
        log.error("query failed: %s", error)
        return failure(str(error), 400)

    def too_large(error):
        if (request.content_length or 0) > settings.max_upload_mb * 1024 * 1024:
            return failure(f"the upload is larger than {settings.max_upload_mb} MB; choose a smaller image", 413)
        return failure(f"a text field is larger than {settings.max_form_kb} KB; the modification text is read up "
                       f"to a few hundred characters: shorten it", 413)

    def unexpected(error):
        if isinstance(error, HTTPException):
            return failure(f"{error.code} {error.name}: {error.description}", error.code)
        log.exception("search request failed")
        return failure("internal error; the server log has the details", 500)

    app.register_error_handler(GalleryIndexError, bad_query)
    app.register_error_handler(SearchError, bad_query)
    app.register_error_handler(DemindError, setup_problem)
    app.register_error_handler(RequestEntityTooLarge, too_large)
    app.register_error_handler(Exception, unexpected)


def read_search_form(searcher: Searcher, rows: dict[str, int]) -> SearchQuery:
    """The query of a POST to /api/search: an upload or a gallery pick, text, method, template, k, negative."""
    form = request.form
    upload = request.files.get("image")
    picked = form.get("gallery_name") or None
    if upload is not None and upload.filename:
        # an uploaded copy of a gallery image is left out of its own results by content
        image, exclude, drop_duplicates = upload.read(), None, True
    elif picked:
        if picked not in rows:
            raise SearchError(f"{picked[:200]!r} is not an image of this index; pick one from the gallery")
        image, exclude, drop_duplicates = searcher.index.image_ref(picked), picked, False
    else:
        image, exclude, drop_duplicates = None, None, False
    k = whole_number("k", form.get("k"), 20, 1, MAX_K)
    return SearchQuery(image=image, text=form.get("text", ""), method=form.get("method") or searcher.default_method,
                       template=form.get("template") or DEFAULT_TEMPLATE, k=k, exclude=exclude,
                       negative=(form.get("negative") or "").strip() or None, drop_duplicates=drop_duplicates)


class ServerThread(threading.Thread):
    """A daemon thread of the server; ``finished`` is set once its target has returned and been let go.

    Waited for instead of ``join()``: up to Python 3.12 a ``join()`` interrupted by Ctrl-C (the
    KeyboardInterrupt that stops demind-serve) marks the thread as stopped while it still runs,
    and every later ``join()`` and ``is_alive()`` says it has ended.
    """

    def __init__(self, target, name: str, args: tuple = ()) -> None:
        super().__init__(target=target, name=name, args=args, daemon=True)
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            super().run()  # drops its target on the way out: maybe the last reference to the app
        finally:
            self.finished.set()


class JoinableTaskDispatcher(waitress.task.ThreadedTaskDispatcher):
    """waitress's pool of worker threads, keeping the threads so that a shutdown can wait for them."""

    def __init__(self) -> None:
        super().__init__()
        self.workers: list[ServerThread] = []

    def start_new_thread(self, target, thread_no: int) -> None:
        worker = ServerThread(target, f"demind-search-worker-{thread_no}", (thread_no,))
        self.workers.append(worker)
        worker.start()


class RunningServer:
    """A waitress server on a background thread: ``port`` (the bound one), ``shutdown()``.

    ``shutdown()`` returns only after the server's threads have let the app go. Why it waits: the
    app (and through it the model's tensors) is held by the loop thread's target, so a loop
    thread that ends after its caller has returned frees the model itself. The process may then
    be exiting: Python ends a daemon thread that takes the GIL back inside torch's tensor
    deallocation (``pthread_exit`` through C++), and the process aborts ("terminate called
    without an active exception", status -6) instead of exiting 0.
    """

    def __init__(self, server, loop: ServerThread, dispatcher: JoinableTaskDispatcher) -> None:
        self._server = server
        self._loop = loop
        self._dispatcher = dispatcher
        self.port: int = server.effective_port

    def _close_sockets(self) -> None:
        """Close every connection, the listening socket and the trigger; an empty map ends the loop."""
        server = self._server
        for channel in list(server._map.values()):
            if channel is not server and channel is not server.trigger:
                try:
                    channel.handle_close()
                except OSError:
                    pass
        server.close()  # the listening socket and the trigger

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Finish the requests being answered (``timeout_s`` at most), close every socket, and
        wait for the loop and worker threads to end (a warning names any still running)."""
        self._dispatcher.shutdown(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        if not self._loop.finished.is_set():
            # closed by the loop's own thread: a socket closed under its select() would fail it (EBADF)
            self._server.trigger.pull_trigger(self._close_sockets)
            self._loop.finished.wait(max(0.0, deadline - time.monotonic()))
        if self._server._map and self._loop.finished.is_set():  # no loop (any more) to close them
            self._close_sockets()
        threads = (self._loop, *self._dispatcher.workers)
        for thread in threads:
            thread.finished.wait(max(0.0, deadline - time.monotonic()))
        running = [t.name for t in threads if not t.finished.is_set()]
        if running:
            log.warning("the search server stopped with %d thread(s) still running after %g s: %s",
                        len(running), timeout_s, ", ".join(running))


def start_server(app: Flask, host: str = "127.0.0.1", port: int = 0) -> tuple[RunningServer, threading.Thread]:
    """Serve ``app`` with waitress from a background thread (``port`` 0: a free port, see
    ``server.port``); stop it with ``server.shutdown()``, which waits for the server's threads.
    Off loopback the app must hold a token."""
    settings: ServerSettings = app.config[SETTINGS_KEY]
    if not guard.is_loopback(host) and settings.token is None:
        raise ServerSetupError(f"serving on {host} (not this machine only) needs an access token: give --token "
                               f"or set DEMIND_SERVE_TOKEN")
    settings.hosts |= guard.default_allowed_hosts(host)
    dispatcher = JoinableTaskDispatcher()
    try:
        server = waitress.server.create_server(
            app, host=host, port=port, threads=settings.threads, connection_limit=settings.connection_limit,
            channel_timeout=settings.channel_timeout_s, cleanup_interval=max(1, int(settings.channel_timeout_s / 2)),
            max_request_body_size=(settings.max_upload_mb + 1) * 1024 * 1024, ident="demind-search",
            _dispatcher=dispatcher)  # waitress's hook for a dispatcher of one's own: ours keeps its threads
    except (OSError, ValueError) as e:  # taken since the start-up check (guard.bind_problem), or not an address
        raise ServerSetupError(f"cannot listen on {host}:{port} ({getattr(e, 'strerror', None) or e}); give another "
                               f"--port (0: any free one) or a --host address of this machine") from None
    dispatcher.set_thread_count(settings.threads)  # started once the port is bound (a port in use starts none)
    thread = ServerThread(server.run, "demind-search-server")
    thread.start()
    return RunningServer(server, thread, dispatcher), thread
