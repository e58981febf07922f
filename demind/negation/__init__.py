

# The face other packages import (the rest of demind.negation is private to it).
# Resolved on first use: importing demind.negation.report (the CLI's --help) loads no torch.
from demind.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.negation.decompose": ["Decomposer", "Decomposition", "RuleDecomposer"],
    "demind.negation.deo": ["DEOConfig", "SubQueries", "optimise"],
})

__all__ = ["DEOConfig", "Decomposer", "Decomposition", "RuleDecomposer", "SubQueries", "optimise"]
