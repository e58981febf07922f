

# The face other packages import (the rest of demind.negation is private to it).
from demind.negation.decompose import Decomposer, Decomposition, RuleDecomposer
from demind.negation.deo import DEOConfig, SubQueries, optimise

__all__ = ["DEOConfig", "Decomposer", "Decomposition", "RuleDecomposer", "SubQueries", "optimise"]
