"""``demind-serve``: the search web page for one checkpoint and one gallery.

    demind-serve --quickstart                      # after pipelines/quickstart.py: toy CIRR gallery
    demind-serve --index runs/photos-index --checkpoint CKPT [--images photos/] [--port 8000]
    demind-serve ... --host 0.0.0.0 --allowed-host photos.lan [--token TOKEN]   # other machines

``--images`` (or ``--quickstart``) builds or updates the index first (only new or changed
files are encoded). The index and the model load once; open the printed address in a browser.
An index of another backbone than the checkpoint's does not stop the server: the page shows
what to do instead. Served by waitress (see demind/search/server.py). By default only this
machine can connect; ``--host`` other than loopback prints a warning and requires an access
token (``--token``, or the environment variable DEMIND_SERVE_TOKEN, or one generated and
printed), which the printed address carries to the page. ``engine.name=transformers
engine.model=DIR`` (demind-eval's engine section, docs/mllm.md) adds the MLLM methods and, with
``rerank.k``, re-ranking; the MLLM loads once, on the first query that needs it.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import urllib.parse
from dataclasses import dataclass

from demind.cli.common import Flag, config_parser, run_config_command
from demind.cli.model_options import (MODEL_FLAGS, SearchModelOptions, bind_search_mllm, load_model, query_mode_problems,
                                      search_mllm_setup)
from demind.settings import setting
from demind.errors import InputError
from demind.search.names import RANKERS, faiss_problem

log = logging.getLogger(__name__)


# Bounds checked with the config, before any model loads: a thread is an operating-system thread
# (100,000 of them fail to start, after the model and index have loaded), and a lock's wait is at
# most threading.TIMEOUT_MAX (a larger --timeout overflows on the first query)
MAX_THREADS = 256
MAX_TIMEOUT_S = 86_400.0


@dataclass
class ServeConfig(SearchModelOptions):
    quickstart: str | None = setting(None, free="a quickstart work folder: one the quickstart has not finished is "
                                                "refused, naming the command to run, before any model loads", help="serve the quickstart's model over its toy CIRR gallery from this "
                                                "work folder (--quickstart alone: runs/quickstart)")
    index: str | None = setting(None, free="an index folder (built here from --images, or by demind-index); one that "
                                           "cannot be opened is shown on the page, the server still starts",
                                help="index folder (built by demind-index, or here from images)")
    images: str | None = setting(None, input="dir", help="build or update the index from this folder first")
    new_folder: bool = setting(False, help="with --images: let an index built from another folder follow it (drops "
                                           "the files only in the old folder), as demind-index --new-folder")
    ranker: str = setting("exact", choices=RANKERS,
                          help="how the gallery is ranked: exact matrix product, or FAISS (pip install -e "
                               "'.[search]'); the start-up line and the page say which, and what recall@10 to expect")
    host: str = setting("127.0.0.1", free="an address; one this machine cannot bind is refused before any model "
                                          "loads", help="127.0.0.1 serves this machine only; another address (0.0.0.0: every "
                                          "interface) needs a token")
    port: int = setting(8000, ge=0, le=65535, help="0: any free port")
    token: str | None = setting(None, free="any text: the secret each request carries", help="access token every request must carry (default: DEMIND_SERVE_TOKEN, or "
                                           "off loopback a generated one, printed)")
    allowed_hosts: list[str] = setting(default_factory=list, free="host names matched against each request's Host "
                                                                 "header", help="host names clients use besides localhost and "
                                                                  "--host (DNS-rebinding check); '*' allows any")
    timeout: float = setting(30.0, gt=0, le=MAX_TIMEOUT_S, help="seconds before an idle connection is closed and a "
                                                                 "query that cannot get the model is refused")
    threads: int = setting(4, ge=1, le=MAX_THREADS, help="worker threads (queries take the one model in turn: more "
                                                         "threads wait, they do not answer faster)")

    def config_problems(self) -> list[tuple[str, str]]:
        problems = []
        if self.new_folder and not (self.images or self.quickstart):
            problems.append(("new_folder", "applies to the index built from --images: add --images DIR, or leave it out"))
        missing = faiss_problem(f"= {self.ranker!r}") if self.ranker != "exact" else None
        if not self.quickstart:  # --quickstart names its checkpoint when the command starts
            problems += query_mode_problems(self.checkpoint, self.run)
        return problems + ([("ranker", missing)] if missing else [])


FLAGS = {**MODEL_FLAGS, "--quickstart": Flag("quickstart", const="runs/quickstart", optional_value=True),
         **{f"--{name}": Flag(name) for name in ("index", "images", "ranker", "host", "port", "token", "timeout",
                                                  "threads")},
         "--allowed-host": Flag("allowed_hosts", many=True), "--new-folder": Flag("new_folder")}
TOKEN_ENV = "DEMIND_SERVE_TOKEN"


def build_parser():
    return config_parser(ServeConfig, "demind-serve", __doc__.split("\n\n")[0], FLAGS)


def resolve_paths(args: ServeConfig) -> None:
    """Fill --checkpoint/--images/--index from the quickstart's layout when --quickstart is given."""
    if args.quickstart:
        from demind.search.run_manifest import read_search_manifest

        paths = read_search_manifest(args.quickstart)  # written by the quickstart when it finishes
        args.checkpoint = args.checkpoint or str(paths["checkpoint"])
        args.images = args.images or str(paths["images"])
        args.index = args.index or str(paths["index"])
    if not args.index or not (args.checkpoint or args.backbone.spec):
        raise InputError("give --quickstart [WORKDIR], or --index DIR with --checkpoint CKPT")


def access_settings(args: ServeConfig):
    """The server's settings: off loopback a warning and a token (given, from the environment, or new)."""
    from demind.search.guard import is_loopback
    from demind.search.server import ServerSettings

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not is_loopback(args.host):
        print(f"warning: --host {args.host} lets other machines connect; every request needs the access token, "
              f"and the page is answered only under localhost, {args.host} and --allowed-host names "
              f"({', '.join(args.allowed_hosts) or 'none given'}). Plain HTTP: use it on a network you trust, "
              f"or behind an HTTPS proxy.", file=sys.stderr, flush=True)
        if token is None:
            token = secrets.token_urlsafe(24)
            print(f"generated access token (give --token or {TOKEN_ENV} to choose one): {token}", flush=True)
    return ServerSettings(token=token, allowed_hosts=tuple(args.allowed_hosts), channel_timeout_s=args.timeout,
                          query_timeout_s=args.timeout, threads=args.threads)


def run(args: ServeConfig) -> int:
    from demind.search.index import build_index, load_index  # model code: not for --help
    from demind.search.index_manifest import GalleryIndexError
    from demind.search.query import Searcher
    from demind.search.expectations import expectation_line
    from demind.search.guard import bind_problem
    from demind.search.server import create_app, start_server

    resolve_paths(args)
    problem = bind_problem(args.host, args.port)  # before any model loads
    if problem:
        raise InputError(problem)
    settings = access_settings(args)
    # the MLLM itself loads on the first query that needs it; an index built here first: its store and
    # answer words are checked now, before the backbone loads and the images are encoded
    mllm = bind_search_mllm(args, args.index) if args.images else search_mllm_setup(args)
    backbone, model = load_model(args)
    if model is not None and args.run.query_mode != "eager":
        # before serving: a compile on the first query would outlast the query timeout (--timeout)
        print(f"compiling the query (run.query_mode={args.run.query_mode}; about a minute on a CPU) ...", flush=True)
        model.warm_up()
    if args.images:
        stats = build_index(args.images, args.index, backbone, progress=args.run.progress, new_root=args.new_folder)
        print(f"index {args.index}: {stats.indexed} images ({stats.encoded} encoded, {stats.cached} reused, "
              f"{len(stats.unreadable)} unreadable)")
    try:
        searcher = Searcher(backbone, model, load_index(args.index), args.ranker, mllm=mllm)
        print(expectation_line(searcher.expectation))  # the page shows the same line (/api/info "ranker_line")
        app = create_app(searcher, settings=settings)
    except GalleryIndexError as e:
        log.error("%s", e)  # the page shows it too; the server still starts
        app = create_app(None, problem=str(e), settings=settings)
    server, thread = start_server(app, args.host, args.port)
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    shown_host = f"[{shown_host}]" if ":" in shown_host else shown_host  # an IPv6 address in a URL
    # URL-encoded: a base64 token's '+' would arrive as a space, its '/' and '=' split the query
    token = f"?token={urllib.parse.quote(settings.token, safe='')}" if settings.token else ""
    address = f"http://{shown_host}:{server.port}/{token}"
    # SIGTERM (a service manager, `kill`, a container stop) ends the server as Ctrl-C does: the
    # uploads' temporary folder and every other clean-up run on the way out. Both are caught from
    # before the address is printed: a stop sent as soon as it appears still shuts down cleanly.
    # SIGINT explicitly too: a process started from a script's background job inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler, so `kill -INT` did nothing
    signal.signal(signal.SIGTERM, stop_as_interrupt)
    signal.signal(signal.SIGINT, stop_as_interrupt)
    try:
        print(f"demind search: {address}  (waitress, {args.threads} threads; checkpoint {args.checkpoint}, "
              f"index {args.index}); Ctrl-C stops it", flush=True)
        thread.join()
    except KeyboardInterrupt:
        server.shutdown()  # waits for the server's threads: the model is freed here, not by one of them at exit
    return 0


def stop_as_interrupt(signum: int, frame: object) -> None:
    """A signal handler that raises KeyboardInterrupt in the main thread (where the server is joined)."""
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    """``demind-serve``: (build and) load the index and model once, then serve the page."""
    return run_config_command(ServeConfig, build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
