"""Every source of training triplets by its ``data.source`` name: the labelled ones of
:mod:`demind.triplets.readers` (cirr, fashioniq, file) and the generated ones (generated:
:mod:`demind.triplets.generated`; megapairs: :mod:`demind.triplets.megapairs`)."""

from __future__ import annotations

from demind.triplets.generated import read_generated_triplets
from demind.triplets.megapairs import read_megapairs
from demind.triplets.readers import TripletSet, read_triplets

GENERATED_SOURCES = ("generated", "megapairs")
"""Sources whose triplets carry hard negatives (``data.hard_negatives``)."""


def read_source(source: str, path: str, *, limit: int | None = None, categories: tuple[str, ...] = (),
                corpus: str = "") -> TripletSet:
    """The triplets of ``source`` at ``path`` (``corpus``: where a generated set's corpus lies now)."""
    if source == "generated":
        return read_generated_triplets(path, corpus, limit)
    if source == "megapairs":
        return read_megapairs(path, limit)
    return read_triplets(source, path, limit=limit, categories=categories) if categories else \
        read_triplets(source, path, limit=limit)
