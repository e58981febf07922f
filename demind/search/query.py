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

With an MLLM (``Searcher(..., mllm=MLLMSetup)``, :mod:`demind.mllm.search_binding`) the query-time family
is offered too: ``cirevl``, ``osrcir`` and ``demind+mllm`` (the description of the query, stored
and reused, comes back with the results), and with ``rerank.k`` > 0 each method's ``+rerank``
variant (its top K re-ordered by the MLLM). Without one they are refused in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from demind.backbone import FrozenCLIP
from demind.errors import DemindError
from demind import retrieval as registry
from demind.retrieval import (EXCLMM_METHODS, METHOD_LABELS, METHODS, MLLM_METHODS, ON_REQUEST_METHODS,
                              RERANK_SUFFIX, base_method, build_methods, method_spec, parse_method_names,
                              split_rerank)
from demind.retrieval import ImageReadError, ImageRef, load_image, reword
from demind.imaging import ImageDecodeError, ImageTooLargeError, decode_image
from demind.model import DeMinds
from demind.templates import TemplateError, fill_template, template_field
from demind.search.index import GalleryIndex, check_index_backbone
from demind.mllm import SearchMLLM
from demind.search.expectations import expectation
from demind.search.ranker_store import open_ranker
from demind.search.rankers import exact_top_k
from demind.search.names import DEFAULT_METHOD, DEFAULT_TEMPLATE, RANKERS

log = logging.getLogger(__name__)

HYBRID = registry.HYBRID_METHOD
# what each method reads (the reference image, the text, the text through the template) is its
# registry entry's (demind.retrieval.names.METHOD_SPECS): no list here to forget a method in


# methods of the registry a search never offers, and why (said when one is asked for)
UNSERVED = {
    **{m: "it ranks in its own sparse space, which an index of CLIP features does not hold; demind-eval "
          "evaluates it on a benchmark" for m in EXCLMM_METHODS},
    **{m: "it reads a benchmark's ground-truth description of the target, which a search does not have"
       for m in ON_REQUEST_METHODS if m not in MLLM_METHODS},
}


def reads_image(name: str) -> bool:
    """Whether the method ``name`` (a variant too) reads the reference image."""
    return method_spec(name).image


def reads_text(name: str) -> bool:
    """Whether the method ``name`` reads the modification text (as typed or through the template)."""
    return method_spec(name).words is not None


def fills_template(name: str) -> bool:
    """Whether the method ``name`` reads the text through the template (its ``*`` is the reference)."""
    return method_spec(name).words == "prompt"


def method_label(name: str) -> str:
    """The page's name of a method: ``"demind+deo-adam"`` -> ``"De-MINDS + DEO (adam)"``,
    ``"osrcir+rerank"`` -> ``"OSrCIR (MLLM reflective CoT) + MLLM re-rank"``."""
    plain, reranked = split_rerank(name)
    base = base_method(plain)
    label = METHOD_LABELS.get(base, base) + (f" + DEO ({plain[len(base) + 5:] or 'exact'})" if plain != base else "")
    return label + (" + MLLM re-rank" if reranked else "")


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
    description: str | None = None  # the MLLM's target description(s) of this query (MLLM methods)
    reranked: int = 0  # how many of the first results the MLLM re-ordered (``+rerank`` methods)


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
        raise SearchError(reword(str(e), "give another image")) from None


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
    method, reranked = split_rerank(query.method)
    base, mode = registry.split_deo_name(method)
    if base not in registry.DEO_BASES:
        why = "has no DEO variant" if base in METHOD_LABELS and reads_text(base) else "reads no text"
        raise SearchError(f"method {query.method!r} {why}, so it cannot exclude {query.negative!r}; "
                          f"use one of {', '.join(registry.DEO_BASES)}")
    negative = " ".join(query.negative.split())
    text = " ".join((query.text or "").split())
    text = f"{text}, without {negative}" if text else f"without {negative}"
    method = method if mode else f"{base}+deo"
    return replace(query, method=method + (RERANK_SUFFIX if reranked else ""), text=text, negative=None)


class Searcher:
    """Embeds composed queries with one checkpoint and ranks one index; both load once.

    ``mllm``: a :class:`demind.mllm.MLLMSetup` (the ``engine`` / ``describe`` / ``rerank``
    sections) for the MLLM methods and ``+rerank``, or one already bound to this index
    (:class:`demind.mllm.SearchMLLM`, :func:`demind.cli.model_options.bind_search_mllm`); its engine
    is built on the first query that needs an answer no store holds."""

    def __init__(self, backbone: FrozenCLIP, model: DeMinds | None, index: GalleryIndex,
                 ranker: str = "exact", mllm=None) -> None:
        check_index_backbone(index, backbone)
        if ranker not in RANKERS:
            raise SearchError(f"unknown ranker {ranker!r}; choose from {', '.join(RANKERS)}")
        self.backbone, self.model, self.index = backbone, model, index
        self.ranker = open_ranker(index, ranker)  # a FAISS ranker saved in the index folder is loaded, not rebuilt
        self.expectation = expectation(self.ranker, index)  # which ranker, what recall@10 to expect
        if mllm is not None and not isinstance(mllm, SearchMLLM):  # a setup: bound to this index here
            mllm = SearchMLLM(mllm, index.directory.name, index.directory)
        self.mllm = mllm
        self.methods: dict[str, registry.RetrievalMethod] = {}  # built on first use
        if self.mllm is not None:
            self.available_methods()  # rerank.methods naming a method this search cannot offer: refused now

    @property
    def default_method(self) -> str:
        """The method a query that names none runs: the checkpoint's own (``combiner`` for a combiner,
        else ``demind``); the page lists it first."""
        return "combiner" if registry.checkpoint_kind(self.model) == "combiner" else DEFAULT_METHOD

    def available_methods(self) -> list[str]:
        """Every method of the registry this checkpoint (and MLLM) allows, its own first, DEO variants
        after the base methods, ``+rerank`` variants of the base methods last (``rerank.k`` > 0)."""
        own = self.default_method
        names = [own] + [m for m in METHODS if m != own] + list(registry.DEO_METHODS)
        unserved = (*UNSERVED, *(MLLM_METHODS if self.mllm is None else ()))
        names = [m for m in names if base_method(m) not in unserved]
        blocked = registry.unavailable_methods(registry.checkpoint_kind(self.model))  # a combiner serves its own
        names = [m for m in names if base_method(m) not in blocked]
        if self.mllm is not None and self.mllm.rerank_k > 0:  # rerank.methods, when given, picks the base methods
            names += [m + RERANK_SUFFIX for m in self.mllm.run.rerank_targets([m for m in names if "+deo" not in m])]
        return names

    def method(self, name: str) -> registry.RetrievalMethod:
        if name not in self.methods:
            run = self.mllm.run if self.mllm is not None else None
            self.methods[name] = build_methods([name], self.backbone, self.model, mllm=run)[0]
        return self.methods[name]

    def validate(self, query: SearchQuery) -> None:
        """SearchError for a query that cannot be answered, naming what to change."""
        plain, reranked = split_rerank(query.method)
        if base_method(plain) in UNSERVED:
            raise SearchError(f"method {query.method!r} does not answer a query against a gallery index "
                              f"({UNSERVED[base_method(plain)]}); choose one of {', '.join(self.available_methods())}")
        if (base_method(plain) in MLLM_METHODS or reranked) and self.mllm is None:
            raise SearchError(f"method {query.method!r} runs a multimodal LLM and this search has none: start it "
                              f"with engine.name=transformers engine.model=DIR (a llava-hf folder; see docs/mllm.md)")
        if reranked and self.mllm.rerank_k == 0:
            raise SearchError(f"method {query.method!r} re-ranks the top rerank.k results, and rerank.k is 0: "
                              f"start the search with rerank.k=20 (for example)")
        try:
            parse_method_names([plain], have_model=self.model is not None,
                               model_kind=registry.checkpoint_kind(self.model) or "demind")
        except ValueError as e:
            raise SearchError(str(e).replace("pass --checkpoint", "start with --checkpoint")) from None
        offered = self.available_methods()
        # the page lists no +deo+rerank variant, but a negative turns METHOD+rerank into one: its base is what counts
        if query.method not in offered and not (reranked and plain in offered):  # e.g. the oracle: a benchmark's
            raise SearchError(f"method {query.method!r} does not answer a query against a gallery index; choose "
                              f"one of {', '.join(self.available_methods())}")
        if reads_text(query.method) and not (query.text or "").strip():
            raise SearchError("the modification text is empty; type what should change, e.g. 'make it red'")
        if len(query.text or "") > MAX_TEXT_CHARS:
            raise SearchError(f"the modification text is {len(query.text):,} characters; at most "
                              f"{MAX_TEXT_CHARS:,} are read (CLIP reads about 77 words): shorten it")
        if reads_image(query.method) and query.image is None:
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
    def _embed(self, query: SearchQuery) -> tuple[torch.Tensor, Image.Image | None, torch.Tensor | None,
                                                  registry.Query | None]:
        """(1, D) query embedding, the decoded reference image and its (1, D) image embedding (None
        when the method reads no image), and the MLLM's Query (None unless the method or a
        re-ranking asks the MLLM)."""
        query = with_negative_as_deo(query)
        self.validate(query)
        plain, reranked = split_rerank(query.method)
        base = base_method(plain)
        picture = None
        if query.image is not None and reads_image(query.method):  # +rerank: the verifier reads it
            picture = read_query_image(query.image)
        if picture is not None and reads_image(plain):
            ref = self.backbone.encode_image(self.backbone.preprocess(picture).unsqueeze(0))
        else:
            ref = torch.zeros(1, self.backbone.embed_dim, device=self.backbone.device)
        text = " ".join(query.text.split())
        prompt = build_prompt(query.template, text) if fills_template(plain) else text
        method = self.method(plain)
        asked = None
        if self.mllm is not None and picture is not None and (base in MLLM_METHODS or reranked):
            asked = self.mllm.query(query.image, picture, text, prompt)
        texts = [text]
        if base in MLLM_METHODS:  # the description(s) of the query, from the store or the MLLM
            texts = method.query_texts([asked])  # a +deo variant asks its base
        embedding = method.embed(ref, [prompt], texts).float().cpu()
        if asked is not None and base in MLLM_METHODS:
            asked = replace(asked, target_description=texts[0])
        return embedding, picture, (ref.float().cpu() if reads_image(plain) and picture is not None else None), asked

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
        became DEO's, the gallery copies of the reference left out (``query.drop_duplicates``), the
        MLLM's description (MLLM methods) and how many results it re-ordered (``+rerank``)."""
        used = with_negative_as_deo(query)
        q, picture, image_embedding, asked = self._embed(used)
        if image_embedding is None and picture is not None and query.drop_duplicates:
            image_embedding = self.backbone.encode_image(self.backbone.preprocess(picture).unsqueeze(0)).float().cpu()
        duplicates = self.duplicates_of(picture, image_embedding) if query.drop_duplicates and picture else []
        excluded = query.excluded_names() | set(duplicates)
        reranked = split_rerank(used.method)[1]
        wanted = max(query.k, self.mllm.rerank_k) if reranked else query.k
        scores, rows = self.ranker.top_k(q, wanted + len(excluded))
        found: list[tuple[str, float]] = []
        for score, row in zip(scores[0].tolist(), rows[0].tolist()):
            if row < 0:  # FAISS pads with -1 when it finds fewer than k
                continue
            name = self.index.names[row]
            if name not in excluded:
                found.append((name, round(float(score), 6)))
        found = found[:wanted]
        reordered = 0
        if reranked and asked is not None and found:
            names = [n for n, _ in found]
            try:
                order = self.mllm.rerank(asked, names, {n: self.index.image_ref(n) for n in names})
            except ImageReadError as e:  # the verifier reads the candidates' files: one gone fails this query
                raise SearchError(reword(str(e), f"a gallery file changed or removed after indexing: update the "
                                                 f"index with demind-index --images FOLDER --index "
                                                 f"{self.index.directory.name}, or search without +rerank")) from None
            score_of = dict(found)
            found = [(n, score_of[n]) for n in order]  # each keeps its retrieval score; the order is the MLLM's
            reordered = min(self.mllm.rerank_k, len(names))
        hits = [SearchHit(i + 1, name, score, str(self.index.path_of(name)))  # a shard member's path is its shard
                for i, (name, score) in enumerate(found[: query.k])]
        description = asked.target_description if asked is not None else None
        return SearchOutcome(hits, used.method, used.text, query.negative, duplicates, description, reordered)

    def gallery_name_of(self, path: str | Path) -> str | None:
        """The indexed name of ``path`` when the file lies in the indexed folder (to exclude it)."""
        try:
            name = Path(path).resolve().relative_to(self.index.root.resolve()).as_posix()
        except ValueError:
            return None
        return name if name in set(self.index.names) else None
