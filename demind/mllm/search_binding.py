"""The MLLM of a search process: describers (``cirevl``, ``osrcir``, ``demind+mllm``) and re-ranking
(``METHOD+rerank``) for queries typed by a user instead of read from a benchmark.

The command line builds the same :class:`demind.mllm.MLLMSetup` as ``demind-eval`` (the
``engine``, ``describe`` and ``rerank`` config sections); :class:`SearchMLLM` binds it once per
process to the index, so the engine is built at most once and only when a description or a
re-ranking score is missing (its :class:`~demind.mllm.LazyEngine`).

The answers are stored by the one rule of :mod:`demind.mllm.store`: keyed by the model's
content, the reference's pixels, the modification text, the prompt texts and the settings; the
index's name is a label only (a copied or renamed index finds its answers). A search query becomes
a :class:`~demind.retrieval.Query` whose id (a label) is a hash of the reference's pixels and the
words. Uploaded bytes are written to a private temporary folder for the describer to read (deleted
with the process). The store (``describe.store``, else ``<index>/descriptions``) must be writable:
one error naming ``describe.store`` before any model loads.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from pathlib import Path
from typing import Any

from PIL import Image

from demind.mllm.digest_memo import pixel_digest
from demind.retrieval import ImageRef, Query

log = logging.getLogger(__name__)

STORE_BENCHMARK = "search"  # the stores' "benchmark" part; the index's folder name is the "split"


def query_key(picture: Image.Image | None, text: str) -> str:
    """The id (a label) of a search query: sha256 of the reference's pixel digest and the
    modification text, 24 hex digits."""
    pixels = pixel_digest(picture) if picture is not None else ""
    return hashlib.sha256(f"{pixels}\x00{text}".encode("utf-8")).hexdigest()[:24]


def descriptions_root(store: str | None, index_directory: Path) -> Path:
    """``describe.store`` if given, else ``<index>/descriptions`` (copied with the index); its
    writability is checked when the setup is bound (:meth:`demind.mllm.MLLMSetup.bind`)."""
    return Path(store) if store else Path(index_directory) / "descriptions"


class SearchMLLM:
    """One :class:`demind.mllm.MLLMRun` for one index: descriptions of user queries, re-ranking."""

    def __init__(self, setup: Any, index_name: str, index_directory: Path) -> None:
        self.setup = setup
        self.run = setup.bind(STORE_BENCHMARK, index_name, descriptions_root(setup.describe.store, index_directory))
        self.run.reranker()  # answer words that cannot work: refused now, before any description
        self._uploads: tempfile.TemporaryDirectory | None = None

    @property
    def model(self) -> str:
        return self.setup.model

    @property
    def rerank_k(self) -> int:
        return self.setup.rerank.k

    @property
    def loaded(self) -> bool:
        return self.setup.engine.loaded

    def reference(self, image: str | Path | ImageRef | bytes, picture: Image.Image, key: str) -> ImageRef:
        """An ImageRef the describer reads: the file or index entry as given, uploaded bytes as a PNG
        of their decoded pixels in this process's private temporary folder."""
        if isinstance(image, ImageRef):
            return image
        if not isinstance(image, (bytes, bytearray)):
            return ImageRef(name=Path(image).name, path=Path(image), orient=True)
        if self._uploads is None:
            self._uploads = tempfile.TemporaryDirectory(prefix="demind-search-uploads-")
        path = Path(self._uploads.name) / f"{key}.png"
        if not path.is_file():
            picture.save(path, format="PNG")
        return ImageRef(name=key, path=path)

    def query(self, image: str | Path | ImageRef | bytes, picture: Image.Image, text: str, prompt: str) -> Query:
        """The Query of one search (``text``: the modification, whitespace already collapsed)."""
        key = query_key(picture, text)
        return Query(qid=key, reference=self.reference(image, picture, key), prompt=prompt, text=text)

    def rerank(self, query: Query, names: list[str], refs: dict[str, ImageRef]) -> list[str]:
        """``names`` (best first) with their first ``rerank.k`` re-ordered by the MLLM verifier."""
        reranker = self.run.reranker()
        if reranker is None:
            return names
        return reranker.rerank([query], {query.qid: names}, refs)[query.qid]

    def summary(self) -> dict[str, Any]:
        """What the page and the JSON say about the MLLM: model, engine, re-ranking K, loaded or not."""
        return {"model": Path(self.model).name if Path(self.model).is_dir() else self.model,
                "engine": self.setup.engine_name, "rerank_k": self.rerank_k, "loaded": self.loaded}
