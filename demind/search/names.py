"""What a search query may name by default: the method, the template and the rankers.

Torch-free, so ``demind-search --help`` / ``demind-serve --help`` list them without loading a
model; :mod:`demind.search.query` uses them.
"""

from __future__ import annotations

import importlib.util

from demind.templates import TEMPLATES

DEFAULT_TEMPLATE = TEMPLATES["cirr"]
DEFAULT_METHOD = "demind"
# exact: one matrix product; faiss-*: the search extra
RANKERS = ("exact", "faiss-flat", "faiss-hnsw", "faiss-ivf", "faiss-ivfpq")
FAISS_HINT = "pip install -e '.[search]' (faiss-cpu)"


def faiss_problem(what: str) -> str | None:
    """Why ``what`` (a ranker choice, ``--measure-rankers``) cannot run here: FAISS is not installed
    (looked up, not imported), else None; a command says it before any model loads."""
    if importlib.util.find_spec("faiss") is not None:
        return None
    return f"{what} needs FAISS, which is not installed: {FAISS_HINT}, or use the exact ranker"
