"""Search over a user's own images: the index (:mod:`.index`), queries and rankers (:mod:`.query`),
the MLLM of the query-time methods and re-ranking (:mod:`.mllm`), the page and API (:mod:`.server`,
needs the ``search`` extra), the runs manifest the page lists
(:mod:`.run_manifest`). Other packages import this face; ``demind/cli`` wires the commands.
"""

from demind.search.run_manifest import write_search_manifest

__all__ = ["write_search_manifest"]
