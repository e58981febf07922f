"""Target-description sampling: which text of an intent sample the model reads.

Per sample, T is the original caption, the rewritten caption or the pseudo-manipulation
description with probabilities 0.5 / 0.3 / 0.2 (the seed paper's Table 10, row 9; its
prose swaps two labels).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class TargetSampling:
    p_original: float = 0.5
    p_rewritten: float = 0.3
    p_intent: float = 0.2

    def __post_init__(self) -> None:
        probs = (self.p_original, self.p_rewritten, self.p_intent)
        if min(probs) < 0 or abs(sum(probs) - 1.0) > 1e-6:
            raise ValueError(f"target sampling probabilities must be >= 0 and sum to 1, got {probs}")


TARGET_KINDS = ("original", "rewritten", "intent")


def sample_target_kind(rng: random.Random, probs: TargetSampling) -> str:
    """Which text to read: one of TARGET_KINDS, drawn with the configured probabilities (one draw)."""
    u = rng.random()
    if u < probs.p_original:
        return "original"
    if u < probs.p_original + probs.p_rewritten:
        return "rewritten"
    return "intent"


def sample_target_text(original: str, rewritten: str, intent: str, rng: random.Random, probs: TargetSampling) -> str:
    """Draw one of the three texts with the configured probabilities."""
    return {"original": original, "rewritten": rewritten, "intent": intent}[sample_target_kind(rng, probs)]
