"""``demind-search``: composed queries against a gallery index, from the command line.

    demind-search --index runs/my-index --checkpoint runs/paper/demind.safetensors \\
        --image ref.jpg --text "make it red" [--method demind] [-k 20] [--out results.json]
    demind-search --index runs/my-index --checkpoint CKPT --queries queries.jsonl --out results.json

Prints the ranked file names with scores and writes them as JSON. A JSONL line is an object
with ``text`` and optionally ``image`` (paths relative to the current folder), ``method``,
``template``, ``k``, ``negative`` and ``id``. A query that cannot be answered (an unreadable
image, an empty text) and a line that is not such an object (bad JSON, ``"text": null``, a
wrong-typed key) are reported, counted and kept in the JSON with their error (naming the file,
line and key); the others run. A query with a negative is recorded as it was searched: the
method's ``+deo`` variant on "TEXT, without NEGATIVE". The reference itself and gallery images
whose pixels equal it (a copy under another name) are left out of the results and named, as the
page does; ``--keep-reference`` keeps them.
Exit status: 0, 1 when some queries could not be answered, 2 on an error (one line).

The MLLM methods (``cirevl``, ``osrcir``, ``demind+mllm``) and re-ranking (``METHOD+rerank`` with
``rerank.k``) take the ``engine``, ``describe`` and ``rerank`` sections of demind-eval
(``engine.name=transformers engine.model=DIR``); without ``engine.model`` they are refused.

Every search error (GalleryIndexError, SearchError) is a DemindError with the fix in its message,
so the command prints it as one line. The model settings and their loading are the ones
demind-eval, demind-index and demind-serve share (:mod:`demind.cli.model_options`).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from demind.errors import InputError
from demind.cli.common import Flag, config_parser, run_config_command
from demind.cli.model_options import MODEL_FLAGS, SearchModelOptions, bind_search_mllm, load_model, query_mode_problems
from demind.settings import setting
from demind.retrieval.names import METHODS
from demind.io import check_output_file, read_jsonl, write_json_atomic
from demind.search.names import DEFAULT_METHOD, DEFAULT_TEMPLATE, RANKERS, faiss_problem

# Model code (and torch) is imported inside the functions that run a search: --help must not load it.
if TYPE_CHECKING:
    from demind.search.query import Searcher, SearchQuery

log = logging.getLogger(__name__)


@dataclass
class SearchConfig(SearchModelOptions):
    index: str | None = setting(None, free="an index folder: opened (a missing one is 'no index at ...') before any "
                                           "model loads", help="index folder written by demind-index (required)")
    image: str | None = setting(None, input="file", help="reference image")
    text: str | None = setting(None, free="the user's words, read whole (never as a template)", help="modification text, e.g. 'make it red'")
    queries: str | None = setting(None, input="file", help="JSONL file of queries instead of image/text")
    method: str | None = setting(None, refuses="no-such-method", help=f"one of {', '.join(METHODS)}, BASE+deo, or METHOD+rerank (the MLLM "
                                             f"methods and +rerank need engine.model); default: the checkpoint's own "
                                             f"({DEFAULT_METHOD}, or combiner for a combiner checkpoint)")
    template: str = setting(DEFAULT_TEMPLATE, refuses="a photo of {text}", help="prompt with one '*' and one field")
    k: int = setting(20, ge=1, help="results per query")
    negative: str | None = setting(None, free="the user's words, read whole", help="what the results must not show: searched as 'TEXT, without "
                                              "NEGATIVE' with the method's +deo variant")
    ranker: str = setting("exact", choices=RANKERS,
                          help="exact matrix product, or FAISS (pip install -e '.[search]'): faiss-flat (exact), "
                               "faiss-hnsw / faiss-ivf / faiss-ivfpq (approximate; their recall@10 is printed; "
                               "built once, saved in the index folder)")
    keep_reference: bool = setting(False, help="allow the reference image among the results: itself when it is "
                                               "in the gallery, and its pixel copies under other names (left out "
                                               "by default, as the page does)")
    out: str | None = setting(None, output="file", help="write the results as JSON here")

    def config_problems(self) -> list[tuple[str, str]]:
        from demind.retrieval.names import method_name_problems
        from demind.templates import TemplateError, template_field

        problems = [("index", "is required: give --index DIR (built by demind-index)")] if self.index is None else []
        problems += method_name_problems("method", self.method)
        problems += query_mode_problems(self.checkpoint, self.run)
        try:
            template_field(self.template)
        except TemplateError as e:
            problems.append(("template", f"= {self.template!r}: {e}"))
        missing = faiss_problem(f"= {self.ranker!r}") if self.ranker != "exact" else None
        return problems + ([("ranker", missing)] if missing else [])


FLAGS = {**MODEL_FLAGS, **{f"--{name}": Flag(name) for name in ("index", "image", "text", "queries", "method",
                                                                  "template", "negative", "ranker", "out")},
         "-k": Flag("k"), "--keep-reference": Flag("keep_reference")}


def build_parser():
    return config_parser(SearchConfig, "demind-search", __doc__.split("\n\n")[0], FLAGS)


QUERY_KEYS = {"text": (str,), "image": (str, type(None)), "method": (str,), "template": (str,), "k": (int,),
              "negative": (str, type(None)), "id": (str, int)}
"""The keys of a JSONL query line and the JSON types each takes (``text`` is required)."""


def parse_query_line(row: object, where: str, defaults: SearchQuery, number: int) -> SearchQuery:
    """One JSONL value -> SearchQuery; InputError naming ``where`` (``file:line``) and the key otherwise."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected an object with 'text' and optionally {', '.join(list(QUERY_KEYS)[1:])}, "
                         f"got a JSON {type(row).__name__}")
    unknown = sorted(set(row) - set(QUERY_KEYS))
    if unknown:
        raise InputError(f"{where}: unknown key(s) {unknown}; a query takes {', '.join(QUERY_KEYS)}")
    if "text" not in row:
        raise InputError(f"{where}: key 'text' is missing (the modification text; \"\" for none)")
    for key, kinds in QUERY_KEYS.items():
        value = row.get(key)
        if key in row and (not isinstance(value, kinds) or isinstance(value, bool)):
            wanted = " or ".join("null" if k is type(None) else {str: "a string", int: "an integer"}[k] for k in kinds)
            raise InputError(f"{where}: key {key!r} must be {wanted}, got {json.dumps(value)}")
    k = row.get("k", defaults.k)
    if k < 1:
        raise InputError(f"{where}: key 'k' must be at least 1, got {k}")
    from demind.search.query import SearchQuery

    return SearchQuery(image=row.get("image"), text=row["text"], method=row.get("method", defaults.method),
                       template=row.get("template", defaults.template), k=k,
                       negative=row.get("negative", defaults.negative), qid=str(row.get("id", number)))


def read_query_file(path: str | Path, defaults: SearchQuery) -> tuple[list[SearchQuery], list[dict]]:
    """Queries from a JSONL file, and a record per bad line (not JSON, wrong keys or types) that
    was skipped: ``{"id", "line", "error"}`` with the error naming the file, line and key."""
    path = Path(path)
    bad_lines: list[tuple[int, str]] = []
    queries = []
    for number, row in read_jsonl(path, what="query file", bad_lines=bad_lines):
        try:
            queries.append(parse_query_line(row, f"{path}:{number}", defaults, number))
        except InputError as e:
            bad_lines.append((number, str(e)))
    if not queries and not bad_lines:
        raise InputError(f"query file {path} holds no queries; write one JSON object a line, e.g. "
                         f'{{"image": "ref.jpg", "text": "make it red"}}')
    skipped = [{"id": str(number), "line": number, "error": message} for number, message in sorted(bad_lines)]
    for record in skipped:
        log.warning("skipping query line: %s", record["error"])
    return queries, skipped


def answer(searcher: Searcher, query: SearchQuery, keep_reference: bool) -> dict:
    """One query's JSON record: the query as searched (an explicit negative turns into the
    ``+deo`` method and "TEXT, without NEGATIVE", and is kept under ``negative``), and its results
    or its error."""
    if query.image is not None and not keep_reference:
        query.exclude = searcher.gallery_name_of(query.image)
        query.drop_duplicates = True  # as the page does: a copy of the reference is not a result
    from demind.search.query import SearchError, with_negative_as_deo

    negative = query.negative
    try:
        query = with_negative_as_deo(query)
    except SearchError as e:
        error = str(e)
    else:
        error = None
    record = {"id": query.qid, "image": None if query.image is None else str(query.image), "text": query.text,
              "method": query.method, "template": query.template, "k": query.k, "excluded": query.exclude}
    if negative:
        record["negative"] = negative
    if error is not None:
        record["error"] = error
        return record
    try:
        outcome = searcher.search_with_details(query)
    except SearchError as e:
        record["error"] = str(e)
        return record
    record["results"] = [h.as_dict() for h in outcome.hits]
    if outcome.description is not None:
        record["description"] = outcome.description
    if outcome.reranked:
        record["reranked"] = outcome.reranked
    if outcome.duplicates:
        record["duplicates"] = outcome.duplicates
    return record


def print_record(record: dict) -> None:
    head = f"[{record['id']}] " if record["id"] else ""
    if "line" in record:  # a skipped line of the query file
        print(f"{head}skipped: {record['error']}")
        return
    print(f"{head}{record['method']}: {record['image']} + {record['text']!r}")
    if "error" in record:
        print(f"  error: {record['error']}")
        return
    if "description" in record:
        print(f"  MLLM description: {record['description']!r}")
    if record.get("reranked"):
        print(f"  the first {record['reranked']} re-ordered by the MLLM")
    for hit in record["results"]:
        print(f"  {hit['rank']:>3}  {hit['score']:.4f}  {hit['name']}")
    if record.get("duplicates"):
        print(f"  left out {len(record['duplicates'])} pixel copy(ies) of the reference: "
              f"{', '.join(record['duplicates'])} (--keep-reference keeps them)")


def check_mllm_methods(methods: list[str], have_mllm: bool) -> None:
    """One line, before any model loads, when every query names an MLLM method and there is no engine
    (a query file mixing methods gets the error per query instead)."""
    from demind.retrieval.names import MLLM_METHODS, base_method, split_rerank

    def needs(m: str) -> bool:
        return split_rerank(m)[1] or base_method(m) in MLLM_METHODS

    if not have_mllm and methods and all(needs(m) for m in methods):
        raise InputError(f"method {methods[0]!r} runs a multimodal LLM: give engine.name=transformers "
                         f"engine.model=DIR (a llava-hf folder; see docs/mllm.md)")


def run(cfg: SearchConfig) -> int:
    from demind.search.expectations import expectation_line
    from demind.search.index import load_index
    from demind.search.query import Searcher, SearchQuery

    defaults = SearchQuery(image=cfg.image, text=cfg.text or "", method=cfg.method, template=cfg.template,
                           k=cfg.k, negative=cfg.negative)
    if cfg.queries:
        if cfg.image or cfg.text:
            raise InputError("give --queries FILE or --image/--text, not both")
        queries, skipped = read_query_file(cfg.queries, defaults)
    elif cfg.text is None and cfg.image is None:
        raise InputError("give --image REF --text 'make it red' (or --queries FILE.jsonl)")
    else:
        queries, skipped = [defaults], []
    if cfg.out:
        check_output_file(cfg.out)
    index = load_index(cfg.index)  # the manifest read, the parts memory-mapped: no row is read yet
    mllm = bind_search_mllm(cfg, cfg.index)  # its store and answer words checked before the model loads
    check_mllm_methods([q.method for q in queries if q.method is not None], mllm is not None)
    backbone, model = load_model(cfg)
    searcher = Searcher(backbone, model, index, cfg.ranker, mllm=mllm)
    for query in queries:  # no --method and none on the line: the checkpoint's own
        query.method = query.method or searcher.default_method
    print(expectation_line(searcher.expectation))
    records = [answer(searcher, q, cfg.keep_reference) for q in queries] + skipped
    for record in records:
        print_record(record)
    failed = sum("error" in r for r in records)
    if failed:
        log.warning("%d of %d queries could not be answered (%d line(s) of the query file skipped; their "
                    "errors are above and in the JSON)", failed, len(records), len(skipped))
    if cfg.out:
        mllm_summary = searcher.mllm.summary() if searcher.mllm is not None else None
        write_json_atomic(cfg.out, {"index": str(cfg.index), "checkpoint": cfg.checkpoint, "ranker": cfg.ranker,
                                     "ranker_expectation": searcher.expectation, "mllm": mllm_summary,
                                     "queries": records}, indent=2)
        print(f"results: {cfg.out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``demind-search``: answer the queries, print and write them; exit status as above."""
    return run_config_command(SearchConfig, build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
