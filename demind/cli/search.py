"""``demind-search``: composed queries against a gallery index, from the command line.

    demind-search --index runs/my-index --checkpoint runs/paper/demind.safetensors \\
        --image ref.jpg --text "make it red" [--method demind] [-k 20] [--out results.json]
    demind-search --index runs/my-index --checkpoint CKPT --queries queries.jsonl --out results.json

Prints the ranked file names with scores and writes them as JSON. A JSONL line is an object
with ``text`` and optionally ``image`` (paths relative to the current folder), ``method``,
``template``, ``k``, ``negative`` and ``id``. A query that cannot be answered (an unreadable
image, an empty text) is reported, counted and kept in the JSON with its error; the others run.
Exit status: 0, 1 when some queries could not be answered, 2 on an error (one line).

This module also holds the two helpers demind-index and demind-serve share (model arguments
and loading).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from demind.checkpoint import load_backbone_and_model
from demind.cli.common import run_command
from demind.eval.methods import METHODS
from demind.io import read_jsonl, write_json_atomic
from demind.search.index import load_index
from demind.search.query import DEFAULT_METHOD, DEFAULT_TEMPLATE, RANKERS, SearchError, Searcher, SearchQuery

log = logging.getLogger(__name__)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--checkpoint / --backbone / --device / --precision, shared by the search commands.

    Every search error (GalleryIndexError, SearchError) is a ValueError with the fix in its
    message, so ``run_command`` prints it as one line."""
    p.add_argument("--checkpoint", help="De-MINDS checkpoint (.safetensors); its backbone is rebuilt from it")
    p.add_argument("--backbone", help="NAME:TAG_OR_PATH for the backbone-only methods without a checkpoint "
                                      "(e.g. ViT-L-14:openai)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--precision", default="fp32", help="backbone precision (fp32, fp16, bf16); the index records it")


def load_model(args: argparse.Namespace):
    """(backbone, model or None) as the arguments ask."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return load_backbone_and_model(args.checkpoint, args.backbone, precision=args.precision, device=device)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demind-search", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True, help="index folder written by demind-index")
    add_model_arguments(p)
    p.add_argument("--image", help="reference image")
    p.add_argument("--text", help="modification text, e.g. 'make it red'")
    p.add_argument("--queries", help="JSONL file of queries instead of --image/--text")
    p.add_argument("--method", default=DEFAULT_METHOD, help=f"one of {', '.join(METHODS)} (default {DEFAULT_METHOD})")
    p.add_argument("--template", default=DEFAULT_TEMPLATE, help=f"prompt with one '*' and one field "
                                                                 f"(default {DEFAULT_TEMPLATE!r})")
    p.add_argument("-k", type=int, default=20, help="results per query (default 20)")
    p.add_argument("--negative", help="what the results must not show: searched as 'TEXT, without NEGATIVE' with the method's +deo variant")
    p.add_argument("--ranker", default="exact", choices=RANKERS,
                   help="exact matrix product (default), or FAISS (pip install -e '.[search]')")
    p.add_argument("--keep-reference", action="store_true",
                   help="allow the reference image itself among the results when it is in the gallery")
    p.add_argument("--out", help="write the results as JSON here")
    return p


def read_query_file(path: str | Path, defaults: SearchQuery) -> list[SearchQuery]:
    """Queries from a JSONL file; a malformed line is an error naming the file and line."""
    path = Path(path)
    queries = []
    for number, row in read_jsonl(path, what="query file"):
        unknown = set(row) - {"id", "image", "text", "method", "template", "k", "negative"} if isinstance(row, dict) else None
        if not isinstance(row, dict) or "text" not in row or unknown:
            raise ValueError(f"{path}:{number} must be an object with 'text' and optionally image, method, "
                             f"template, k, negative, id" + (f" (unknown keys {sorted(unknown)})" if unknown else ""))
        queries.append(SearchQuery(image=row.get("image"), text=str(row["text"]),
                                   method=row.get("method", defaults.method),
                                   template=row.get("template", defaults.template), k=int(row.get("k", defaults.k)),
                                   negative=row.get("negative", defaults.negative), qid=str(row.get("id", number))))
    if not queries:
        raise ValueError(f"query file {path} holds no queries")
    return queries


def answer(searcher: Searcher, query: SearchQuery, keep_reference: bool) -> dict:
    """One query's JSON record: the query, and its results or its error."""
    if query.image is not None and not keep_reference:
        query.exclude = searcher.gallery_name_of(query.image)
    record = {"id": query.qid, "image": None if query.image is None else str(query.image), "text": query.text,
              "method": query.method, "template": query.template, "k": query.k, "excluded": query.exclude}
    try:
        record["results"] = [h.as_dict() for h in searcher.search(query)]
    except SearchError as e:
        record["error"] = str(e)
    return record


def print_record(record: dict) -> None:
    head = f"[{record['id']}] " if record["id"] else ""
    print(f"{head}{record['method']}: {record['image']} + {record['text']!r}")
    if "error" in record:
        print(f"  error: {record['error']}")
        return
    for hit in record["results"]:
        print(f"  {hit['rank']:>3}  {hit['score']:.4f}  {hit['name']}")


def run(args: argparse.Namespace) -> int:
    defaults = SearchQuery(image=args.image, text=args.text or "", method=args.method, template=args.template,
                           k=args.k, negative=args.negative)
    if args.queries:
        if args.image or args.text:
            raise ValueError("give --queries FILE or --image/--text, not both")
        queries = read_query_file(args.queries, defaults)
    elif args.text is None and args.image is None:
        raise ValueError("give --image REF --text 'make it red' (or --queries FILE.jsonl)")
    else:
        queries = [defaults]
    backbone, model = load_model(args)
    searcher = Searcher(backbone, model, load_index(args.index), args.ranker)
    records = [answer(searcher, q, args.keep_reference) for q in queries]
    for record in records:
        print_record(record)
    failed = sum("error" in r for r in records)
    if failed:
        log.warning("%d of %d queries could not be answered (their errors are above and in the JSON)",
                    failed, len(records))
    if args.out:
        write_json_atomic(args.out, {"index": str(args.index), "checkpoint": args.checkpoint,
                                     "ranker": args.ranker, "queries": records}, indent=2)
        print(f"results: {args.out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``demind-search``: answer the queries, print and write them; exit status as above."""
    return run_command(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
