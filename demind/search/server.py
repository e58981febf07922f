"""The search web page: a small Flask app over one loaded :class:`~demind.search.query.Searcher`.

Flask (with its own WSGI server, werkzeug) is chosen because the page needs four routes,
one upload and JSON: Flask does that with no async runtime, no build step and no assets from
a CDN, and werkzeug's threaded server is enough for a local demo. (gradio would bring a
large front-end bundle and fonts fetched online; FastAPI needs uvicorn and python-multipart
for the same four routes.) The page itself is one offline HTML file, ``static/search.html``.

The index and the model are loaded once, before the app is built. Every bad request (an
unreadable upload, an empty text, an unknown method, an index of another backbone) is
answered with a JSON ``{"error": message}`` that the page shows; an unexpected failure is
logged with its traceback on the server and the page gets one line; the server keeps serving.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from functools import lru_cache
from importlib import resources

from demind.config import MissingDependencyError
from demind.eval.structures import ImageRef, load_image

try:
    from flask import Flask, Response, jsonify, request
    from werkzeug.exceptions import HTTPException, RequestEntityTooLarge
    from werkzeug.serving import BaseWSGIServer, make_server
except ImportError as e:  # an optional extra: say how to get it instead of a traceback
    raise MissingDependencyError(f"the search page needs Flask: pip install -e '.[search]' ({e})") from e
from demind.search.index import GalleryIndexError
from demind.search.query import DEFAULT_TEMPLATE, SearchError, Searcher, SearchQuery, method_label

log = logging.getLogger(__name__)

THUMB_SIDE = 192
MAX_UPLOAD_MB = 20
MAX_K = 200


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


def create_app(searcher: Searcher | None, problem: str | None = None) -> Flask:
    """The Flask app. ``searcher`` None with a ``problem`` (e.g. an index of another backbone)
    serves the page with that message instead of results, so the user sees what to fix."""
    if searcher is None and not problem:
        raise ValueError("create_app needs a searcher or a problem to show")
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_UPLOAD_MB * 1024 * 1024
    lock = threading.Lock()  # one query at a time through the model (torch modules are not re-entrant-safe)
    rows = {name: i for i, name in enumerate(searcher.index.names)} if searcher else {}

    @lru_cache(maxsize=4096)
    def cached_thumbnail(name: str) -> bytes:
        return thumbnail_png(searcher.index.image_ref(name))

    @app.get("/")
    def index_page():
        return Response(page_html(), mimetype="text/html")

    @app.get("/api/info")
    def info():
        if searcher is None:
            return jsonify({"problem": problem, "methods": [], "gallery_size": 0})
        return jsonify({
            "problem": None,
            "methods": [{"name": m, "label": method_label(m)} for m in searcher.available_methods()],
            "template": DEFAULT_TEMPLATE,
            "gallery_size": len(searcher.index),
            "index": str(searcher.index.directory),
            "backbone": searcher.index.backbone,
        })

    @app.get("/api/gallery")
    def gallery():
        """Gallery names containing ``q`` (to pick a reference), ``limit`` at most."""
        if searcher is None:
            return jsonify({"names": [], "total": 0})
        needle = request.args.get("q", "").strip().lower()
        limit = min(int(request.args.get("limit", 48)), 500)
        names = [n for n in searcher.index.names if needle in n.lower()] if needle else searcher.index.names
        return jsonify({"names": names[:limit], "total": len(names)})

    @app.get("/thumb")
    def thumb():
        name = request.args.get("name", "")
        if searcher is None or name not in rows:  # only indexed files are served
            return jsonify({"error": f"{name!r} is not in the index"}), 404
        try:
            return Response(cached_thumbnail(name), mimetype="image/png")
        except OSError as e:
            return jsonify({"error": f"cannot read {name}: {e}"}), 404

    @app.post("/api/search")
    def search():
        if searcher is None:
            raise SearchError(problem)
        form = request.form
        upload = request.files.get("image")
        picked = form.get("gallery_name") or None
        if upload is not None and upload.filename:
            image, exclude = upload.read(), None
        elif picked:
            if picked not in rows:
                raise SearchError(f"{picked!r} is not an image of this index; pick one from the gallery")
            image, exclude = searcher.index.image_ref(picked), picked  # never answer with the reference itself
        else:
            image, exclude = None, None
        try:
            k = int(form.get("k", 20))
        except ValueError:
            raise SearchError(f"k must be a whole number, got {form.get('k')!r}") from None
        query = SearchQuery(image=image, text=form.get("text", ""), method=form.get("method", "demind"),
                            template=form.get("template") or DEFAULT_TEMPLATE, k=min(k, MAX_K), exclude=exclude,
                            negative=form.get("negative") or None)
        start = time.perf_counter()
        with lock:
            hits = searcher.search(query)
        elapsed = time.perf_counter() - start
        log.info("query %r (%s): %d results in %.1f ms", query.text, query.method, len(hits), elapsed * 1000)
        return jsonify({
            "results": [{"rank": h.rank, "name": h.name, "score": h.score} for h in hits],
            "method": query.method, "text": query.text, "excluded": exclude,
            "elapsed_ms": round(elapsed * 1000, 1),
        })

    @app.errorhandler(SearchError)
    @app.errorhandler(GalleryIndexError)
    def bad_query(error):
        return jsonify({"error": str(error)}), 400

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(error):
        return jsonify({"error": f"the upload is larger than {MAX_UPLOAD_MB} MB; choose a smaller image"}), 413

    @app.errorhandler(Exception)
    def unexpected(error):
        if isinstance(error, HTTPException):
            return jsonify({"error": f"{error.code} {error.name}: {error.description}"}), error.code
        log.exception("search request failed")
        return jsonify({"error": f"internal error ({type(error).__name__}: {error}); the server log has the "
                                 f"details"}), 500

    return app


def start_server(app: Flask, host: str = "127.0.0.1", port: int = 0) -> tuple[BaseWSGIServer, threading.Thread]:
    """Serve ``app`` from a background thread (``port`` 0: a free port, see ``server.port``);
    stop it with ``server.shutdown()``."""
    server = make_server(host, port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="demind-search-server", daemon=True)
    thread.start()
    return server, thread
