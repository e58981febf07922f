"""Search over a user's own images: the index (:mod:`.index`), queries and rankers (:mod:`.query`),
the page and API (:mod:`.server`, needs the ``search`` extra), the runs manifest the page lists
(:mod:`.run_manifest`). The query-time MLLM of a search process (describers, re-ranking) is bound
to an index in :mod:`demind.mllm.search_binding`. Other packages import this face; ``demind/cli``
wires the commands.
"""

from demind.search.run_manifest import write_search_manifest

__all__ = ["write_search_manifest"]
