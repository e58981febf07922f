"""``demind-serve``: the search web page for one checkpoint and one gallery.

    demind-serve --quickstart                      # after pipelines/quickstart.py: toy CIRR gallery
    demind-serve --index runs/photos-index --checkpoint CKPT [--images photos/] [--port 8000]

``--images`` (or ``--quickstart``) builds or updates the index first (only new or changed
files are encoded). The index and the model load once; open the printed address in a browser.
An index of another backbone than the checkpoint's does not stop the server: the page shows
what to do instead.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from demind.errors import InputError
from demind.cli.common import Flag, config_parser, run_config_command
from demind.cli.search import MODEL_FLAGS, ModelOptions, load_model
from demind.config import setting
from demind.search.index import GalleryIndexError, build_index, load_index
from demind.search.query import RANKERS, Searcher

log = logging.getLogger(__name__)


@dataclass
class ServeConfig(ModelOptions):
    quickstart: str | None = setting(None, help="serve the quickstart's model over its toy CIRR gallery from this "
                                                "work folder (--quickstart alone: runs/quickstart)")
    index: str | None = setting(None, help="index folder (built by demind-index, or here from images)")
    images: str | None = setting(None, help="build or update the index from this folder first")
    ranker: str = setting("exact", choices=RANKERS)
    host: str = setting("127.0.0.1", help="127.0.0.1 serves this machine only")
    port: int = setting(8000, ge=0, le=65535, help="0: any free port")


FLAGS = {**MODEL_FLAGS, "--quickstart": Flag("quickstart", const="runs/quickstart", optional_value=True),
         **{f"--{name}": Flag(name) for name in ("index", "images", "ranker", "host", "port")}}


def build_parser():
    return config_parser(ServeConfig, "demind-serve", __doc__.split("\n\n")[0], FLAGS)


def resolve_paths(args: ServeConfig) -> None:
    """Fill --checkpoint/--images/--index from the quickstart's layout when --quickstart is given."""
    if args.quickstart:
        from demind.search.manifest import read_search_manifest

        paths = read_search_manifest(args.quickstart)  # written by the quickstart when it finishes
        args.checkpoint = args.checkpoint or str(paths["checkpoint"])
        args.images = args.images or str(paths["images"])
        args.index = args.index or str(paths["index"])
    if not args.index or not (args.checkpoint or args.backbone.spec):
        raise InputError("give --quickstart [WORKDIR], or --index DIR with --checkpoint CKPT")


def run(args: ServeConfig) -> int:
    from demind.search.server import create_app, start_server

    resolve_paths(args)
    backbone, model = load_model(args)
    if args.images:
        stats = build_index(args.images, args.index, backbone, progress=args.run.progress)
        print(f"index {args.index}: {stats.indexed} images ({stats.encoded} encoded, {stats.cached} reused, "
              f"{len(stats.unreadable)} unreadable)")
    try:
        app = create_app(Searcher(backbone, model, load_index(args.index), args.ranker))
    except GalleryIndexError as e:
        log.error("%s", e)  # the page shows it too; the server still starts
        app = create_app(None, problem=str(e))
    server, thread = start_server(app, args.host, args.port)
    print(f"demind search: http://{args.host}:{server.port}/  (checkpoint {args.checkpoint}, index {args.index}); "
          f"Ctrl-C stops it", flush=True)
    try:
        thread.join()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``demind-serve``: (build and) load the index and model once, then serve the page."""
    return run_config_command(ServeConfig, build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
