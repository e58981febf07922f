"""What a search query may name by default: the method, the template and the rankers.

Torch-free, so ``demind-search --help`` / ``demind-serve --help`` list them without loading a
model; :mod:`demind.search.query` uses them.
"""

from __future__ import annotations

from demind.templates import TEMPLATES

DEFAULT_TEMPLATE = TEMPLATES["cirr"]
DEFAULT_METHOD = "demind"
# exact: one matrix product; faiss-*: the search extra
RANKERS = ("exact", "faiss-flat", "faiss-hnsw", "faiss-ivf", "faiss-ivfpq")
