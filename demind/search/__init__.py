"""Search over a user's own images: the index (:mod:`.index`), queries and rankers (:mod:`.query`),
the page and API (:mod:`.server`, needs the ``search`` extra), the runs manifest the page lists
(:mod:`.run_manifest`). The query-time MLLM of a search process (describers, re-ranking) is bound
to an index in :mod:`demind.mllm.search_binding`. Other packages import this face (pair mining
takes the exact and FAISS rankers from it); ``demind/cli`` wires the commands.
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.search.names import RANKERS
    from demind.search.rankers import Ranker
    from demind.search.run_manifest import write_search_manifest

# Resolved on first use: the rankers load torch, the ranker names (torch-free) do not
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.search.names": ["RANKERS"],
    "demind.search.rankers": ["Ranker"],
    "demind.search.run_manifest": ["write_search_manifest"],
})

__all__ = ["RANKERS", "Ranker", "write_search_manifest"]
