"""Composed queries against a gallery index: embed through the evaluation methods, rank.

A query (reference image + modification text, through a template with one ``*``) is embedded
by the same method classes the benchmarks use (``demind.retrieval.methods``), so a search and a
benchmark run of one checkpoint score images identically. Ranking is an exact matrix product
by default; FAISS (``pip install -e '.[search]'``) gives the same ranking with ``IndexFlatIP``
and an approximate one with HNSW for large galleries.

Methods are whatever the evaluation registry offers (validated by ``parse_method_names``), so
DEO's ``<method>+deo`` variants (``demind.negation``: automatic decomposition of "... without the
dog") are offered too. An explicit negative text (``SearchQuery.negative``, ``--negative``) is
handed to DEO: the text gains "without <negative>" and the method its ``+deo`` variant, so the
rule decomposer reads the negative back (see :func:`with_negative_as_deo`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from demind.backbone import FrozenCLIP
from demind.config import MissingDependencyError
from demind.errors import DemindError
from demind import retrieval as registry
from demind.retrieval import (CHECKPOINT_METHODS, EXCLMM_METHODS, METHOD_LABELS, METHODS, ON_REQUEST_METHODS,
                                 build_methods, parse_method_names)
from demind.retrieval import ImageReadError, ImageRef, load_image
from demind.imaging import ImageDecodeError, ImageTooLargeError, decode_image
from demind.model import TEMPLATES, DeMinds, TemplateError, fill_template, template_field
from demind.search.index import GalleryIndex, check_index_backbone

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = TEMPLATES["cirr"]
DEFAULT_METHOD = "demind"
RANKERS = ("exact", "faiss-flat", "faiss-hnsw")
IMAGE_METHODS = ("image-only", "image+text", "mapping-only", "demind")  # need a reference image
TEXT_METHODS = ("text-only", "image+text", "mapping-only", "demind")    # need a modification text
PROMPT_METHODS = ("mapping-only", "demind")                              # fill the template


def base_method(name: str) -> str:
    """``"demind+deo"`` -> ``"demind"``: what a DEO variant needs is what its base method needs."""
    return name.split("+deo", 1)[0]


def method_label(name: str) -> str:
    """The page's name of a method: ``"demind+deo-adam"`` -> ``"De-MINDS + DEO (adam)"``."""
    base = base_method(name)
    return METHOD_LABELS.get(base, base) + (f" + DEO ({name[len(base) + 5:] or 'exact'})" if name != base else "")


MAX_QUERY_PIXELS = 40_000_000  # an uploaded reference larger than this is refused before it is decoded
MAX_TEXT_CHARS = 2000  # CLIP reads 77 tokens; a longer text only costs tokenisation time


class SearchError(DemindError, ValueError):
    """A query that cannot be answered as given; the message says what to change."""


@dataclass
class SearchQuery:
    """One composed query.

    image: reference image (a path, an indexed image's ImageRef, or the bytes of an uploaded
        file), or None for text-only.
    text: the modification text ("make it red").
    template: the prompt with one ``*`` (the pseudo-word) and one ``{text}`` field.
    exclude: gallery name(s) never returned (the reference itself when it was picked from the gallery).
    negative: what the results must not show (DEO hook, see the module docstring).
    drop_duplicates: also leave out gallery images whose pixels equal the reference's (an
        uploaded copy of a gallery image would otherwise come back as its own first result).
    """

    image: str | Path | ImageRef | bytes | None
    text: str
    method: str = DEFAULT_METHOD
    template: str = DEFAULT_TEMPLATE
    k: int = 20
    exclude: str | Collection[str] | None = None
    negative: str | None = None
    qid: str | None = None
    drop_duplicates: bool = False

    def excluded_names(self) -> set[str]:
        if self.exclude is None:
            return set()
        return {self.exclude} if isinstance(self.exclude, str) else set(self.exclude)


@dataclass
class SearchHit:
    rank: int
    name: str
    score: float
    path: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SearchOutcome:
    """What :meth:`Searcher.search_with_details` searched and found: ``method`` and ``text`` as
    searched (a negative turns "demind" + "make it red" into "demind+deo" + "make it red, without
    the dog"), the ``negative`` as given, and the gallery ``duplicates`` of the reference left out."""

    hits: list[SearchHit]
    method: str
    text: str
    negative: str | None
    duplicates: list[str] = field(default_factory=list)


def read_query_image(image: str | Path | ImageRef | bytes, max_pixels: int = MAX_QUERY_PIXELS) -> Image.Image:
    """Decode a reference image (path, ImageRef or uploaded bytes) to RGB; SearchError naming it if it fails.

    Uploaded bytes larger than ``max_pixels`` are refused from the size in their header, before
    any pixel is decoded (a 168 KB PNG can hold 144 megapixels, ~430 MB as RGB); the message
    names no server path and no Python exception."""
    if isinstance(image, (bytes, bytearray)):
        try:
            return decode_image(image, orient=True, max_pixels=max_pixels)
        except ImageTooLargeError as e:
            if e.width is None:  # beyond Pillow's own limit: refused by Image.open itself
                raise SearchError(f"the uploaded reference image has more than {max_pixels / 1e6:g} megapixels; "
                                  f"upload a smaller image") from None
            raise SearchError(f"the uploaded reference image is {e.width} x {e.height} pixels "
                              f"({e.width * e.height / 1e6:.0f} megapixels); the limit is {max_pixels / 1e6:g} "
                              f"megapixels: upload a smaller image") from None
        except ImageDecodeError:
            raise SearchError("the uploaded reference image cannot be read as an image; upload a PNG, JPEG, "
                              "WebP or GIF image") from None
    ref = image if isinstance(image, ImageRef) else ImageRef(name=Path(image).name, path=Path(image), orient=True)
    if not ref.path.is_file():
        raise SearchError(f"reference image {ref.path} does not exist")
    try:
        return load_image(ref)
    except ImageReadError as e:
        raise SearchError(str(e).replace("remove it from the split", "give another image")) from None


def build_prompt(template: str, text: str) -> str:
    """The template's one field filled with ``text``: ``("a {domain} of *", "sketch")`` -> ``"a sketch of *"``.

    A template needs one ``*`` (the reference image's pseudo-word) and one plain ``{field}``;
    anything else (format specs, conversions, attribute or index access) is a SearchError."""
    try:
        field_name = template_field(template)
    except TemplateError as e:
        raise SearchError(f"{e}; e.g. {DEFAULT_TEMPLATE!r}") from None
    return fill_template(template, **{field_name: text})


def with_negative_as_deo(query: SearchQuery) -> SearchQuery:
    """An explicit negative becomes DEO's: "make it red" + negative "the dog" is searched as
    "make it red, without the dog" with the method's ``+deo`` variant (the rule decomposer
    reads the negative back out). A query without a negative is returned unchanged."""
    if not (query.negative or "").strip():
        return query
    base, mode = registry.split_deo_name(query.method)
    if base not in registry.DEO_BASES:
        raise SearchError(f"method {query.method!r} reads no text, so it cannot exclude {query.negative!r}; "
                          f"use one of {', '.join(registry.DEO_BASES)}")
    negative = " ".join(query.negative.split())
    text = " ".join((query.text or "").split())
    text = f"{text}, without {negative}" if text else f"without {negative}"
    return replace(query, method=query.method if mode else f"{base}+deo", text=text, negative=None)


HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 80, 128  # chosen by recall@10 on clustered vectors (BENCHMARKS.md)
CHUNK_ROWS = 8192  # rows converted to float32 at a time: a 16 MiB buffer that stays in cache


def _float_chunks(blocks: list[torch.Tensor], chunk: int = CHUNK_ROWS):
    """(offset, (n, D) float32 rows) over ``blocks``: float32 rows are passed as they are (no copy),
    others converted a chunk at a time into one reused buffer."""
    offset, buffer = 0, None
    for block in blocks:
        for start in range(0, len(block), chunk):
            rows = block[start:start + chunk]
            if rows.dtype != torch.float32:
                if buffer is None:
                    buffer = torch.empty(chunk, rows.shape[1])
                rows = buffer[:len(rows)].copy_(rows)
            yield offset + start, rows
        offset += len(block)


def exact_top_k(blocks: list[torch.Tensor], queries: torch.Tensor, k: int,
                batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, D) queries against the rows of ``blocks`` -> (B, k) inner products and row indices, best first.

    A row-major product (rows (n, D) @ queries (D, B)) over each chunk of rows in their stored
    precision, converted to float32 a chunk at a time, written into one (N, B) score buffer; queries
    in batches of ``batch``."""
    total = sum(len(b) for b in blocks)
    if len(queries) == 1 and blocks and all(b.dtype == torch.float16 for b in blocks):
        found = _exact_top_k_fp16(blocks, queries[0].float(), k, total)
        if found is not None:
            return found
    out_scores, out_rows = [], []
    for first in range(0, len(queries), batch):
        q = queries[first:first + batch].float().T.contiguous()
        scores = torch.empty(total, q.shape[1])
        for offset, rows in _float_chunks(blocks):
            torch.mm(rows, q, out=scores[offset:offset + len(rows)])
        top = torch.topk(scores, k, dim=0)
        out_scores.append(top.values.T)
        out_rows.append(top.indices.T)
    return torch.cat(out_scores), torch.cat(out_rows)


FP16_MARGIN = 2e-3  # > twice the error of a float16 product of unit vectors (output and query rounding)


def _exact_top_k_fp16(blocks: list[torch.Tensor], query: torch.Tensor, k: int,
                      total: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One (D,) query over float16 rows at the speed of torch's float16 matrix-vector product (it
    reads half the bytes; it accumulates in float32 and rounds each score to float16): every row
    within ``FP16_MARGIN`` of the k-th of those scores is rescored in float32, so the result is
    that of the float32 product. None when too many rows tie (the caller takes the float32 path)."""
    scores = torch.empty(total, dtype=torch.float16)
    offset, q16 = 0, query.half()
    for block in blocks:
        torch.mv(block, q16, out=scores[offset:offset + len(block)])
        offset += len(block)
    kth = float(torch.topk(scores, k).values[-1])
    candidates = torch.nonzero(scores.float() >= kth - FP16_MARGIN)[:, 0]
    if len(candidates) > 1 << 16:
        return None
    starts = torch.tensor(np.cumsum([0] + [len(b) for b in blocks]))
    which = torch.searchsorted(starts, candidates, right=True) - 1
    rows = torch.empty(len(candidates), query.shape[0])
    for block in torch.unique(which).tolist():
        mask = which == block
        rows[mask] = blocks[block][candidates[mask] - starts[block]].float()
    top = torch.topk(rows @ query, k)
    return top.values[None], candidates[top.indices][None]


class Ranker:
    """Top-k inner-product search over L2-normalised rows: one (N, D) tensor or the blocks of an index."""

    def __init__(self, features: torch.Tensor | list[torch.Tensor], kind: str = "exact", hnsw_m: int = HNSW_M,
                 ef_search: int = HNSW_EF_SEARCH, ef_construction: int = HNSW_EF_CONSTRUCTION) -> None:
        if kind not in RANKERS:
            raise SearchError(f"unknown ranker {kind!r}; choose from {', '.join(RANKERS)}")
        self.kind = kind
        self.blocks = [features] if isinstance(features, torch.Tensor) else list(features)
        self.size = sum(len(b) for b in self.blocks)
        self.faiss_index = None
        self.build_s, self.recall_at_10 = 0.0, 1.0  # what to expect of this ranker (exact ones: 1)
        if kind == "faiss-hnsw":
            start = time.perf_counter()
            self.faiss_index = build_hnsw_index(self.blocks, hnsw_m, ef_search, ef_construction)
            self.build_s = time.perf_counter() - start
            self.recall_at_10 = self.measured_recall()
            log.info("faiss-hnsw over %d rows (M %d, efConstruction %d, efSearch %d): built in %.1f s, recall@10 "
                     "%.3f against exact search", self.size, hnsw_m, ef_construction, ef_search, self.build_s,
                     self.recall_at_10)
        elif kind == "faiss-flat":
            faiss_module()  # the same exact result, by FAISS's kernel over the stored rows (no copy)

    @property
    def features(self) -> torch.Tensor:
        """(N, D) float32 copy of every row (small galleries, tests)."""
        return torch.cat([b.float() for b in self.blocks])

    def measured_recall(self, n: int = 100, k: int = 10) -> float:
        """recall@k of this ranker against exact search, on ``n`` queries made of the gallery (the
        normalised mean of two random rows: near the gallery, as real queries are, but not in it)."""
        if self.size < 2:
            return 1.0
        g = torch.Generator().manual_seed(0)
        pick = torch.randint(0, self.size, (n, 2), generator=g)
        starts = np.cumsum([0] + [len(b) for b in self.blocks])

        def row(i: int) -> torch.Tensor:  # one row of the blocks, without joining them
            block = int(np.searchsorted(starts, i, side="right")) - 1
            return self.blocks[block][i - starts[block]].float()

        queries = torch.nn.functional.normalize(torch.stack([row(a) + row(b) for a, b in pick.tolist()]), dim=-1)
        k = min(k, self.size)
        _, truth = exact_top_k(self.blocks, queries, k)
        _, found = self.top_k(queries, k)
        return sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(truth, found)) / (n * k)

    def top_k(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D) queries -> (B, k') scores and row indices, best first; k' = min(k, N)."""
        k = min(k, self.size)
        queries = queries.float().cpu()
        if self.kind == "exact":
            return exact_top_k(self.blocks, queries, k)
        if self.kind == "faiss-hnsw":
            scores, rows = self.faiss_index.search(queries.contiguous().numpy(), k)
            return torch.from_numpy(scores), torch.from_numpy(rows).long()
        faiss, found = faiss_module(), []
        for offset, rows in _float_chunks(self.blocks, 1 << 16):
            scores, index = faiss.knn(queries.contiguous().numpy(), rows.numpy(), min(k, len(rows)),
                                      metric=faiss.METRIC_INNER_PRODUCT)
            found.append((torch.from_numpy(scores), torch.from_numpy(index).long() + offset))
        scores, rows = torch.cat([s for s, _ in found], 1), torch.cat([r for _, r in found], 1)
        top = torch.topk(scores, k, dim=1)
        return top.values, torch.gather(rows, 1, top.indices)


def faiss_module():
    try:
        import faiss
    except ImportError as e:
        raise MissingDependencyError("rankers faiss-flat and faiss-hnsw need FAISS: pip install -e '.[search]' "
                                     "(faiss-cpu)") from e
    return faiss


def build_hnsw_index(blocks: list[torch.Tensor], hnsw_m: int = HNSW_M, ef_search: int = HNSW_EF_SEARCH,
                     ef_construction: int = HNSW_EF_CONSTRUCTION):
    """FAISS HNSW (approximate inner product) over the rows of ``blocks``; it keeps its own float32
    copy of the rows, which its graph search reads."""
    faiss = faiss_module()
    index = faiss.IndexHNSWFlat(blocks[0].shape[1] if blocks else 1, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    index.hnsw.efSearch = ef_search
    for _, rows in _float_chunks(blocks, 1 << 16):
        index.add(np.ascontiguousarray(rows.numpy()))
    return index


class Searcher:
    """Embeds composed queries with one checkpoint and ranks one index; both load once."""

    def __init__(self, backbone: FrozenCLIP, model: DeMinds | None, index: GalleryIndex,
                 ranker: str = "exact") -> None:
        check_index_backbone(index, backbone)
        self.backbone, self.model, self.index = backbone, model, index
        self.ranker = Ranker(index.blocks, ranker)
        self.methods: dict[str, registry.RetrievalMethod] = {}  # built on first use

    def available_methods(self) -> list[str]:
        """Every method of the registry this checkpoint allows, De-MINDS first (DEO variants last)."""
        names = [DEFAULT_METHOD] + [m for m in METHODS if m != DEFAULT_METHOD] + list(getattr(registry, "DEO_METHODS", ()))
        # ExclMM ranks in its own sparse space (the gallery must be mapped) and the oracle needs a
        # benchmark's ground-truth description: neither answers a user's query against this index.
        names = [m for m in names if base_method(m) not in EXCLMM_METHODS + ON_REQUEST_METHODS]
        return [m for m in names if self.model is not None or base_method(m) not in CHECKPOINT_METHODS]

    def method(self, name: str) -> registry.RetrievalMethod:
        if name not in self.methods:
            self.methods[name] = build_methods([name], self.backbone, self.model)[0]
        return self.methods[name]

    def validate(self, query: SearchQuery) -> None:
        """SearchError for a query that cannot be answered, naming what to change."""
        try:
            parse_method_names([query.method], have_model=self.model is not None)
        except ValueError as e:
            raise SearchError(str(e).replace("pass --checkpoint", "start with --checkpoint")) from None
        if query.method not in self.available_methods():  # e.g. the oracle: a benchmark's, not a user's
            raise SearchError(f"method {query.method!r} does not answer a query against a gallery index; choose "
                              f"one of {', '.join(self.available_methods())}")
        base = base_method(query.method)
        if base in TEXT_METHODS and not (query.text or "").strip():
            raise SearchError("the modification text is empty; type what should change, e.g. 'make it red'")
        if len(query.text or "") > MAX_TEXT_CHARS:
            raise SearchError(f"the modification text is {len(query.text):,} characters; at most "
                              f"{MAX_TEXT_CHARS:,} are read (CLIP reads about 77 words): shorten it")
        if base in IMAGE_METHODS and query.image is None:
            raise SearchError(f"method {query.method!r} needs a reference image")
        if query.k < 1:
            raise SearchError(f"k must be at least 1, got {query.k}")
        build_prompt(query.template, "x")  # every method: a template given is checked, even where it is not read
        if len(self.index) == 0:
            raise SearchError(f"the index {self.index.directory.name} holds no images; build it from a folder "
                              f"of images with demind-index")

    @torch.no_grad()
    def embed(self, query: SearchQuery) -> torch.Tensor:
        """(1, D) L2-normalised query embedding."""
        return self._embed(query)[0]

    @torch.no_grad()
    def _embed(self, query: SearchQuery) -> tuple[torch.Tensor, Image.Image | None, torch.Tensor | None]:
        """(1, D) query embedding, the decoded reference image and its (1, D) image embedding (None
        when the method reads no image)."""
        query = with_negative_as_deo(query)
        self.validate(query)
        base = base_method(query.method)
        picture = None
        if query.image is not None and base in IMAGE_METHODS:
            picture = read_query_image(query.image)
            ref = self.backbone.encode_image(self.backbone.preprocess(picture).unsqueeze(0))
        else:
            ref = torch.zeros(1, self.backbone.embed_dim, device=self.backbone.device)
        text = " ".join(query.text.split())
        prompt = build_prompt(query.template, text) if base in PROMPT_METHODS else text
        embedding = self.method(query.method).embed(ref, [prompt], [text]).float().cpu()
        return embedding, picture, (ref.float().cpu() if picture is not None else None)

    def duplicates_of(self, picture: Image.Image, image_embedding: torch.Tensor, candidates: int = 8) -> list[str]:
        """Gallery names whose pixels equal ``picture``'s: the rows nearest to its (1, D) image
        embedding (cosine >= 0.99, at most ``candidates``) are decoded and compared pixel for pixel,
        so only exact copies are named, whatever their file format or name."""
        scores, rows = exact_top_k(self.index.blocks, torch.nn.functional.normalize(image_embedding, dim=-1),
                                   min(candidates, len(self.index)))
        scores, rows = scores[0], rows[0]
        pixels = np.asarray(picture)
        same = []
        for score, row in zip(scores.tolist(), rows.tolist()):
            if score < 0.99:
                break
            name = self.index.names[row]
            try:
                other = load_image(self.index.image_ref(name))
            except ImageReadError:
                continue
            if other.size == picture.size and np.array_equal(np.asarray(other), pixels):
                same.append(name)
        return same

    def search(self, query: SearchQuery) -> list[SearchHit]:
        """The top ``query.k`` gallery images, best first (the excluded names never appear)."""
        return self.search_with_details(query).hits

    def search_with_details(self, query: SearchQuery) -> SearchOutcome:
        """:meth:`search`, with what was searched: the method and text after an explicit negative
        became DEO's, and the gallery copies of the reference left out (``query.drop_duplicates``)."""
        used = with_negative_as_deo(query)
        q, picture, image_embedding = self._embed(used)
        duplicates = self.duplicates_of(picture, image_embedding) if query.drop_duplicates and picture else []
        excluded = query.excluded_names() | set(duplicates)
        scores, rows = self.ranker.top_k(q, query.k + len(excluded))
        hits = []
        for score, row in zip(scores[0].tolist(), rows[0].tolist()):
            if row < 0:  # FAISS pads with -1 when it finds fewer than k
                continue
            name = self.index.names[row]
            if name in excluded:
                continue
            hits.append(SearchHit(len(hits) + 1, name, round(float(score), 6), str(self.index.path_of(name))))
            # (a shard member's path is its shard; the name says which member)
        return SearchOutcome(hits[: query.k], used.method, used.text, query.negative, duplicates)

    def gallery_name_of(self, path: str | Path) -> str | None:
        """The indexed name of ``path`` when the file lies in the indexed folder (to exclude it)."""
        try:
            name = Path(path).resolve().relative_to(self.index.root.resolve()).as_posix()
        except ValueError:
            return None
        return name if name in set(self.index.names) else None
