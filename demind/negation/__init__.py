"""Negation in composed queries: DEO (decompose a query, then optimise its embedding).

Modules: :mod:`.decompose` (rule decomposer: what is wanted, what must be absent), :mod:`.llm` (the
LLM decomposer), :mod:`.deo` (the embedding optimisation), :mod:`.report` (the rule decomposer on
the labelled phrasings). See docs/negation.md.
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.negation.decompose import Decomposer, Decomposition, RuleDecomposer
    from demind.negation.deo import DEOConfig, SubQueries, optimise

# The face other packages import (the rest of demind.negation is private to it).
# Resolved on first use: importing demind.negation.report (the CLI's --help) loads no torch.
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.negation.decompose": ["Decomposer", "Decomposition", "RuleDecomposer"],
    "demind.negation.deo": ["DEOConfig", "SubQueries", "optimise"],
})

__all__ = ["DEOConfig", "Decomposer", "Decomposition", "RuleDecomposer", "SubQueries", "optimise"]
